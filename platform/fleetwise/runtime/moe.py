"""What a rank's trainer does for a mixture of experts (fleetwise.models.moe): the balance loss's
gradient scale, the expert counts of each step summed over the job, the auxiliary-loss-free bias
update, and the metrics.

Each MoE layer keeps its counts of each forward (`MoE.stats`: tokens per expert, dropped slots, the
balance loss, 1). After the backward the monitor sums the last `microbatches` of them (one forward
per micro-batch: torch's pipeline stage runs one forward more at the job's first step, on
stand-in inputs, to learn its tensors' shapes) into one [layers, experts + 3] matrix per step -- a row per block of the whole model, zero where this rank
holds no MoE block (a pipeline stage holds some) -- and sums them over the job with one all-reduce:
every step with load_balance=bias (each rank then moves its routers' biases identically), else once
per reading step for all the steps since the last (the trainer's metrics are read then too).
Summed over the ranks, a block's row counts each token of the global batch once: its layer lives on
one pipeline stage, each data-parallel rank routes its own samples, and of the mp ranks of a
data rank (which route the same tokens: sequence parallelism is refused with experts) only mp rank
0 counts.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from fleetwise.models.init import model_name
from fleetwise.models.moe import STAT_AUX, STAT_DROPPED, STAT_FORWARDS, MoE
from fleetwise.rundir import Metric, moe_layer_metric

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertMonitor:
    """The MoE layers of this rank's parts and the job's expert counts (see the module's doc)."""

    def __init__(
        self,
        parts: list[nn.Module],
        moe,
        num_layers: int,
        microbatches: int,
        device: torch.device,
        world_size: int,
        counted: bool = True,
    ):
        """moe: the model.moe section (fleetwise.families.moe.MoE); microbatches: the forwards of
        each block in a step on this rank; counted: whether this rank's counts enter the job's sum
        (tensor parallelism: the mp ranks of a data rank route the same tokens, only mp rank 0's
        are counted)."""
        self.counted = counted
        self.num_experts, self.world_size, self.device = moe.num_experts, world_size, device
        self.microbatches = microbatches
        self.num_layers = num_layers
        self.bias_rate = moe.bias_update_rate if moe.load_balance == "bias" else None
        self.layers: list[tuple[int, MoE]] = []
        for part in parts:
            for name, module in part.named_modules():
                if isinstance(module, MoE):
                    found = _LAYER.search(model_name(name) + ".")
                    assert found, f"a MoE layer outside the blocks: {name}"
                    self.layers.append((int(found[1]), module))
        self._pending: list[torch.Tensor] = []  # per step since the last read: [layers, E + 3]
        self._reduced = 0  # how many of the pending steps are summed over the job already

    def set_grad_scale(self, scale: float) -> None:
        """The scale the trainer's loss gradient carries this step (balance losses get the same)."""
        for _, module in self.layers:
            module.aux_grad_scale = scale

    def after_backward(self) -> None:
        """Take the step's counts; with load_balance=bias, sum them over the job and move the biases."""
        step = torch.zeros(self.num_layers, self.num_experts + 3, device=self.device)
        for layer, module in self.layers:
            stats = module.take_stats()
            if stats is not None and self.counted:
                step[layer] += stats[-self.microbatches :].sum(0)
        self._pending.append(step)
        if self.bias_rate is not None:
            self._reduce()
            self._move_biases(step)

    def _reduce(self) -> None:
        """Sum the pending steps not summed yet over the job, in one all-reduce."""
        todo = self._pending[self._reduced :]
        if todo and self.world_size > 1:
            block = torch.stack(todo)
            dist.all_reduce(block)
            for i, summed in enumerate(block.unbind(0)):
                todo[i].copy_(summed)
        self._reduced = len(self._pending)

    @torch.no_grad()
    def _move_biases(self, step: torch.Tensor) -> None:
        """DeepSeek-V3's update: each expert's bias moves by bias_update_rate towards balance (up for
        the experts that got fewer tokens than the mean, down for those that got more), centred so
        the biases keep a mean of zero (torchtitan does the same)."""
        for layer, module in self.layers:
            counts = step[layer, : self.num_experts]
            delta = self.bias_rate * torch.sign(counts.mean() - counts)
            module.router.expert_bias.add_(delta - delta.mean())

    def read(self) -> list[dict[str, float]]:
        """The metrics of each step since the last read (summed over the job; one host read)."""
        self._reduce()
        steps, self._pending, self._reduced = self._pending, [], 0
        if not steps:
            return []
        table = torch.stack(steps).cpu().tolist()
        # the job's MoE blocks, this stage's and the others': the rows with forwards counted
        moe_rows = [i for i in range(self.num_layers) if any(t[i][STAT_FORWARDS] > 0 for t in table)]
        return [self._metrics(rows, moe_rows) for rows in table]

    def _metrics(self, rows: list[list[float]], moe_rows: list[int]) -> dict[str, float]:
        e = self.num_experts
        out: dict[str, float] = {}
        aux = dropped = worst = 0.0
        for layer in moe_rows:
            row = rows[layer]
            counts = row[:e]
            mean = sum(counts) / e
            balance = max(counts) / mean if mean else 0.0
            worst = max(worst, balance)
            dropped += row[STAT_DROPPED]
            aux += row[STAT_AUX] / row[STAT_FORWARDS] if row[STAT_FORWARDS] else 0.0
            out[moe_layer_metric(layer, "load_max_over_mean")] = balance
            for expert, count in enumerate(counts):
                out[moe_layer_metric(layer, f"tokens_expert{expert}")] = count
        return {Metric.MOE_AUX_LOSS: aux, Metric.MOE_DROPPED: dropped, Metric.MOE_LOAD: worst, **out}
