"""The whole job: `RunConfig`, the root of conf/config.yaml, and the sections config.yaml defines
itself (train, launch, run, checkpoint, tracking, fault, plan, auto).

Each config group of conf/ has its schema in the module of its name (config/data.py, optim.py,
strategy.py, hardware.py, model.py); RunConfig ties them together. Workers and library code
receive a validated `RunConfig`, never a raw DictConfig.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from fleetwise.config.base import Section
from fleetwise.config.data import DataConfig
from fleetwise.config.hardware import HardwareConfig
from fleetwise.config.model import ModelConfig
from fleetwise.config.optim import OptimConfig
from fleetwise.config.strategy import StrategyConfig


class TrainConfig(Section):
    global_batch_size: int = Field(ge=1, description="Samples per optimizer step, whole job.")
    micro_batch_size: int = Field(ge=1, description="Samples per forward/backward on one rank.")
    accumulate_steps: int | None = Field(
        None,
        ge=1,
        description="Micro-batches per step per data-parallel rank (pipeline: micro-batches in flight).",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Compute dtype (params stay fp32)."
    )
    steps: int = Field(ge=1, description="Optimizer steps to run.")
    seed: int = Field(42, description="Seed of the model initialisation.")
    log_interval: int = Field(
        10,
        ge=1,
        description="Steps between console lines, and between reads of the device (the first step reads "
        "too): the steps in between never wait for it, nor for the other ranks (their metrics are "
        "read, and a non-finite gradient found, at the next one; every step still reaches "
        "metrics.jsonl and MLflow). 1 reads every step and names a non-finite gradient's parameter.",
    )
    warmup_steps_excluded: int = Field(
        2, ge=0, description="Leading steps left out of throughput summaries (start-up, allocator warm-up)."
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (after tensor parallelism and activation "
        "checkpointing, before FSDP/DDP, as torchtitan does); the first steps pay the compile time.",
    )


class LaunchConfig(Section):
    nnodes: Annotated[str, BeforeValidator(str)] = Field(
        "1", description="Nodes in the rendezvous: N, or MIN:MAX for elastic jobs."
    )
    node_rank: int = Field(0, ge=0, description="This node's rank (static multi-node launch).")
    rdzv_endpoint: str = Field(
        "127.0.0.1:0", description="host:port of the c10d rendezvous (port 0: pick a free one)."
    )
    rdzv_id: str | None = Field(
        None,
        description="Rendezvous id shared by all nodes of one job (default: run.name, else a hash of the "
        "resolved config without node_rank and run.dir, which every node derives alike).",
    )
    max_restarts: int = Field(0, ge=0, description="torchrun restarts of the whole group after a failure.")
    rdzv_last_call_s: int = Field(
        30, ge=1, description="Elastic jobs: after MIN nodes joined, wait this long for more before starting."
    )
    collective_timeout_s: float = Field(
        300.0, gt=0, description="A collective that hangs longer fails the job."
    )
    monitor_interval_s: float = Field(0.5, gt=0, description="How often torchrun checks its workers.")
    oversubscribe: bool = Field(
        False, description="Start more CPU ranks than this machine's cores and free memory hold (warned)."
    )


class RunDirConfig(Section):
    dir: str | None = Field(None, description="Run directory (default: Hydra's output dir).")
    name: str | None = Field(
        None, description="Run name shown in MLflow (default: recipe-strategy-hardware)."
    )
    overwrite: bool = Field(
        False, description="Reuse a non-empty run.dir without resuming: the old job's files are removed."
    )


class CheckpointConfig(Section):
    interval: int = Field(0, ge=0, description="Save every N steps (0: only at the end when enabled).")
    enabled: bool = Field(False, description="Write checkpoints at all.")
    keep: int = Field(2, ge=1, description="Newest complete checkpoints kept.")
    resume: Literal["none", "auto"] | str = Field(
        "none", description="none, auto (newest complete checkpoint of run.dir), or a checkpoint path."
    )


def _scalar_text(value: object) -> str:
    if isinstance(value, dict | list):
        # a dotted key (+tracking.tags.a.b=x) composes into a nested group, which MLflow can't tag
        raise ValueError("a tag takes one value; use a key without dots, e.g. +tracking.tags.team=nlp")
    return str(value)


class TrackingConfig(Section):
    enabled: bool = Field(True, description="Log the run to MLflow from rank 0.")
    experiment: str = Field("fleetwise", description="MLflow experiment name.")
    system_metrics: bool = Field(
        True, description="Log CPU/RAM/GPU through MLflow's system metrics (every node of a multi-node job)."
    )
    log_model: bool = Field(
        True,
        description="At the end of a successful job, log the trained model as an MLflow model "
        "(weights, signature, config) with its evaluation loss `eval/loss`.",
    )
    register_as: str | None = Field(
        None, description="Register the logged model under this name in the MLflow Model Registry."
    )
    tags: dict[str, Annotated[str, BeforeValidator(_scalar_text)]] = Field(
        default_factory=dict,
        description="Your own tags on the MLflow run (`+tracking.tags.team=nlp`); keys starting with "
        "fleetwise. or mlflow. are reserved.",
    )
    model_max_bytes: int = Field(
        2 << 30,
        ge=0,
        description="Largest model (fp32 bytes, from the plan) consolidated onto the launching host; a "
        "larger one is logged as a reference to its sharded checkpoint plus the loader.",
    )


class FaultConfig(Section):
    """Test hooks to inject failures; they never fire unless set."""

    kill_rank: int | None = Field(None, ge=0, description="Rank that fails (test hook).")
    at_step: int | None = Field(None, ge=1, description="Step at which it fails.")
    mode: Literal["raise", "exit", "sigkill", "hang", "nan_grad"] = Field(
        "raise", description="How it fails: exception, os._exit, SIGKILL, hang, or a NaN gradient (nan_grad)."
    )
    on_nonfinite: Literal["abort", "skip"] = Field(
        "abort", description="NaN/Inf loss or gradient: abort or skip the step."
    )


class PlanCheckConfig(Section):
    memory_check: Literal["error", "warn", "off"] = Field(
        "error", description="What validate/train do when the plan does not fit in device memory."
    )


class AutoConfig(Section):
    """Constraints of `strategy=auto`, the layout search (plan/search.py)."""

    max_mp: int | None = Field(
        None, ge=1, description="Largest tensor-parallel degree searched (null: devices per node)."
    )
    max_cp: int | None = Field(
        None,
        ge=1,
        description="Largest context-parallel degree searched, for gpt and llama (null: devices per node "
        "when seq_len >= 32768, else 1; a number: at any seq_len).",
    )
    objective: Literal["time", "memory"] = Field(
        "time", description="Rank fitting layouts by planned step time, or by memory per device."
    )
    headroom: float = Field(
        0.10, ge=0, lt=1, description="Fraction of usable device memory a chosen layout must leave free."
    )
    top_k: int = Field(10, ge=1, description="Layouts shown in the candidate table.")


class RunConfig(Section):
    recipe: str = Field(description="Recipe the job was composed from, e.g. gpt/tiny.")
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig
    strategy: StrategyConfig
    hardware: HardwareConfig
    launch: LaunchConfig = LaunchConfig()
    run: RunDirConfig = RunDirConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    fault: FaultConfig = FaultConfig()
    plan: PlanCheckConfig = PlanCheckConfig()
    auto: AutoConfig = AutoConfig()

    @model_validator(mode="after")
    def _model_reads_data(self) -> RunConfig:
        """A model whose planner units depend on its data (your own model: traced on the dataset's
        items, families/custom) is told the data section; the built-in families' are not."""
        bind = getattr(self.model, "bind_data", None)
        if bind is not None:
            bind(self.data)
        return self
