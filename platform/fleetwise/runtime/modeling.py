"""From the validated config to a model, its loss, its tensor-parallel plan and its data source."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fleetwise.config.model import CTRModel, ERNIEModel, GPTModel, ResNetModel
from fleetwise.config.run import RunConfig


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[..., nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    inputs: tuple[str, ...]  # batch keys fed to the first pipeline stage, in order
    tp_plan: Callable[[bool], dict] | None = None  # sequence_parallel -> plan (None: no tensor parallelism)
    label: str = "labels"


def model_spec(cfg: RunConfig) -> ModelSpec:
    m = cfg.model
    if isinstance(m, GPTModel):
        from fleetwise.models.gpt import GPT, lm_loss
        from fleetwise.models.tp_plan import gpt_plan

        return ModelSpec(GPT, lm_loss, ("tokens",), gpt_plan)
    if isinstance(m, ERNIEModel):
        from fleetwise.models.ernie import ERNIE
        from fleetwise.models.gpt import lm_loss
        from fleetwise.models.tp_plan import ernie_plan

        return ModelSpec(ERNIE, lm_loss, ("tokens", "token_types"), ernie_plan)
    if isinstance(m, ResNetModel):
        from fleetwise.models.resnet import ResNet, classification_loss

        return ModelSpec(ResNet, classification_loss, ("images",))
    assert isinstance(m, CTRModel)
    from fleetwise.models.ctr import CTRNet, ctr_loss

    return ModelSpec(CTRNet, ctr_loss, ("sparse_ids", "dense"))


def build_meta_model(cfg: RunConfig) -> nn.Module:
    """The model's structure on the `meta` device: no memory, no values (see materialize)."""
    with torch.device("meta"):
        return model_spec(cfg).build(cfg.model)


def materialize(part: nn.Module, device: torch.device, seed: int, *, params_on_host: bool = False) -> None:
    """Allocate a (possibly sharded) meta-built part on `device` -- only this rank's shards -- and
    fill it with its slice of the layout-invariant initial values (fleetwise.models.init).
    params_on_host: parameters on the CPU, buffers on `device` (FSDP with CPU offload)."""
    from fleetwise.models.init import init_weights_

    part.to_empty(device=torch.device("cpu") if params_on_host else device)
    init_weights_(part, seed)
    if params_on_host and device.type != "cpu":
        for module in part.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)


def build_model(cfg: RunConfig) -> nn.Module:
    """The whole model on the host, with the initial values every layout starts from."""
    model = build_meta_model(cfg)
    materialize(model, torch.device("cpu"), cfg.train.seed)
    return model


def build_source(cfg: RunConfig):
    """The sample source for the model family and data config (see fleetwise.data)."""
    m, d = cfg.model, cfg.data
    if isinstance(m, GPTModel | ERNIEModel):
        from fleetwise.data.tokens import SyntheticTokens, TokenFile

        if d.source == "token_file":
            base = TokenFile(d.path, m.seq_len)
            space = base.space_id
        else:
            # ERNIE reserves the last id for [MASK]; synthetic text never emits it
            vocab = m.vocab_size - 1 if isinstance(m, ERNIEModel) else m.vocab_size
            base = SyntheticTokens(vocab, m.seq_len, d.seed, d.num_samples)
            space = None
        if isinstance(m, GPTModel):
            return base
        from fleetwise.data.masking import MaskedLM

        return MaskedLM(
            base,
            seq_len=m.seq_len,
            vocab_size=m.vocab_size,
            masking=m.masking,
            mask_prob=m.mask_prob,
            max_span_words=m.max_span_words,
            seed=d.seed,
            space_id=space,
        )
    if isinstance(m, ResNetModel):
        from fleetwise.data.images import ImageArray, ImageFolder, SyntheticImages

        if d.source == "image_array":
            return ImageArray(d.path)
        if d.source == "image_folder":
            return ImageFolder(d.path, m.image_size)
        return SyntheticImages(m.num_classes, m.image_size, m.in_channels, d.seed, d.num_samples)
    from fleetwise.data.ctr import SyntheticClicks

    return SyntheticClicks(m, d)
