"""What the platform needs to know about a model family, in one record (`Family`), and the
rank-side parts of it (`ModelSpec`).

A `Family` is importable without torch: its schema, its validation rules, its planner units and
the capabilities the strategy rules ask about are plain Python. Its rank-side parts (`spec`:
builder, loss, batch inputs and tensor-parallel plan; `source`: the sample source) are functions
that import torch, the family's `model`, `tp_plan` and `data` modules, `fleetwise.models` and
`fleetwise.data` only when a rank calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem
from fleetwise.models.contract import ModelContract
from fleetwise.plan.units import Unit


@dataclass(frozen=True)
class ModelSpec:
    """The rank-side parts of a family (callables over torch; this record itself is torch-free)."""

    # model config -> nn.Module, called under torch.device("meta"); it obeys the model contract
    # (fleetwise.models.contract: blocks in `layers`, first/last modules, how parameters start),
    # which the runtime checks on every model it builds
    build: Callable[[Any], ModelContract]
    loss: Callable[[Any, Any], Any]  # (output, labels) -> scalar tensor
    inputs: tuple[str, ...]  # batch keys fed to the first pipeline stage, in order
    tp_plan: Callable[[bool], dict] | None = None  # sequence_parallel -> plan (None: no tensor parallelism)
    # fills a materialised (possibly sharded) part with pretrained weights instead of the initial
    # values (Llama's model.init_from), or None
    load_weights: Callable[[Any], None] | None = None
    label: str = "labels"
    # batch keys passed by keyword when the batch has them (Llama: `positions` of packed documents,
    # data=jsonl); not through a pipeline schedule, which validate refuses for such data
    optional_inputs: tuple[str, ...] = ()


def _no_problems(*_: Any) -> Iterator[Problem]:
    return iter(())


def _zero(_: Any) -> int:
    return 0


def _no_notes(_: Any) -> list[str]:
    return []


def _no_profile(_m: Any, _d: Any) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    name: str  # the `model.family` tag (and conf/model/<name>.yaml)
    # pydantic model of the `model` section: `family: Literal[name]` and `num_layers` (the blocks a
    # pipeline split distributes)
    schema: type[Section]
    units: Callable[[Any], list[Unit]]  # the model as a chain of planner units
    input_bytes: Callable[[Any], int]  # bytes of one sample of the batch, as the data source builds it
    spec: Callable[[Any], ModelSpec]  # rank side: imports torch when called
    source: Callable[[Any, Any], Any]  # rank side: (model, data config) -> sample source
    check: Callable[[Any], Iterator[Problem]] = _no_problems  # rules on the model section alone
    limits: Callable[[Any], Iterator[Problem]] = _no_problems  # sizes the planner cannot represent
    # fills the raw `model` dict in place before it is parsed and returns its problems (Llama: the
    # fields model.init_from's config.json sets), or None
    prefill: Callable[[dict], list[Problem]] | None = None
    tokens_per_sample: Callable[[Any], int] = _zero  # token models: sequence length
    plan_notes: Callable[[Any], list[str]] = _no_notes  # lines the plan prints about the model
    data_sources: tuple[str, ...] = ()  # file-backed data.source readers for this family
    # (model, data config) -> the model fields (and data settings) its synthetic samples depend on;
    # part of the dataset's digest in MLflow
    data_profile: Callable[[Any, Any], dict] = _no_profile
    # Tensor parallelism: a check of mp_degree against the shapes, or None when the family has no
    # tensor-parallel plan; then `no_tensor_parallel` says why and what to do instead.
    tensor_parallel: Callable[[Any, int], Iterator[Problem]] | None = None
    no_tensor_parallel: tuple[str, str] = (
        "its layers are not split by fleetwise",
        "set strategy.mp_degree=1 and use dp or sharding",
    )
    # (why, fix) when pp_degree > 1 cannot work / there is nothing to recompute; or a function of
    # the model section giving it (Llama: a tied head; your own model: what its trace found)
    no_pipeline: tuple[str, str] | Callable[[Any], tuple[str, str] | None] | None = None
    no_recompute: tuple[str, str] | Callable[[Any], tuple[str, str] | None] | None = None
    # the model's chain for a pipeline is checked by tracing it (your own model, whose blocks keep
    # their own name), not by the model contract's naming checks of `layers` and the ends
    chain_traced: bool = False
    # (why, fix) when strategy=ps cannot train the family at all
    no_parameter_server: tuple[str, str] | None = None
    # Parameter server: the sparse tables that can live on servers (None: the family has none,
    # and the ps runtime cannot train it), the floats of one table row, every parameter's shape.
    sparse_tables: Callable[[Any], list] | None = None
    sparse_row_width: Callable[[Any], int] = _zero
    parameter_shapes: Callable[[Any], list[tuple[str, tuple[int, ...]]]] | None = None
    convolutional: bool = False  # 16-bit GPU runs use channels_last
    # the loss of a model that has learned nothing (uniform guesses): what a run's loss is shown against
    chance_loss: Callable[[Any], float] | None = None
    # its checkpoints export as a Hugging Face model directory (`checkpoint export --format hf`;
    # logged beside the MLflow model: tracking/models.py)
    exports_hf: bool = False

    def pipeline_refusal(self, model: Any) -> tuple[str, str] | None:
        """(why, fix) when this model cannot be pipelined, else None."""
        return self.no_pipeline(model) if callable(self.no_pipeline) else self.no_pipeline

    def recompute_refusal(self, model: Any) -> tuple[str, str] | None:
        return self.no_recompute(model) if callable(self.no_recompute) else self.no_recompute
