"""The training loop of one rank: forward/backward over micro-batches (or a pipeline schedule),
clip, step, and per-step metrics reduced across ranks onto rank 0.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fleetwise.compat import compile_counters, scaler_found_inf
from fleetwise.config.engine import Engine
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.data.loader import StepBatches
from fleetwise.families import family_of
from fleetwise.plan.records import Plan
from fleetwise.rundir import Metric, append_record
from fleetwise.runtime import checkpoint
from fleetwise.runtime.faults import inject_fault
from fleetwise.runtime.memory import TensorPeak, rss_peak_bytes
from fleetwise.runtime.mesh import DistEnv
from fleetwise.runtime.modeling import build_source
from fleetwise.runtime.moe import ExpertMonitor
from fleetwise.runtime.optim import Optimizers, Zero1Optimizers, step_kernel
from fleetwise.runtime.parallelize import DTYPES, ParallelModel, memory_format, parallelize

log = logging.getLogger("fleetwise")

# the columns of a step's row in the metrics matrix `_read_records` gathers from every rank
_COLUMNS = ("loss", "norm", "finite", "reports_loss", "time", "peak", "rss", "reserved")
_LOSS, _NORM, _FINITE, _REPORTS, _TIME, _PEAK, _RSS, _RESERVED = range(len(_COLUMNS))


class Trainer:
    def __init__(self, cfg: RunConfig, plan: Plan, env: DistEnv, run_dir: Path, allocate=None):
        """allocate: how the meta-built model gets its tensors (see parallelize; the dry run's are fake)."""
        self.cfg, self.plan, self.env, self.run_dir = cfg, plan, env, run_dir
        self.layout = layout = Layout.of(cfg)
        self.mesh = layout.build_mesh(env.device.type)
        self.coords = layout.coords(env.rank)
        self.model: ParallelModel = parallelize(cfg, self.mesh, env.device, allocate)
        self.optimizers: Optimizers
        # (only FSDP offloads: runtime/parallelize.py)
        self.offloaded = self.model.engine == Engine.FSDP and getattr(cfg.strategy, "offload", False)
        kernel = step_kernel(cfg.hardware.device_type, self.offloaded, cfg.optim.name)
        if self.model.engine == Engine.ZERO1:
            self.optimizers = Zero1Optimizers(
                self.model.parts,
                cfg.optim,
                cfg.train,
                self.mesh,
                # ZeRO-1's working weights are 16-bit under mixed precision (runtime/zero1.py)
                working_dtype=DTYPES[cfg.train.precision],
                # a pipeline schedule's gradients are summed over micro-batches (scale_grads=False)
                grad_divisor=cfg.train.accumulate_steps if layout.pp > 1 else 1,
                kernel=kernel,
                # gloo: all-reduces instead of its slower reduce-scatter and all-gather (the plan's too)
                all_reduce=cfg.hardware.backend == "gloo",
            )
        else:
            self.optimizers = Optimizers(self.model.parts, cfg.optim, cfg.train, kernel)
        self.pp_group = self.mesh["pp"].get_group() if layout.pp > 1 else None
        source = build_source(cfg)
        # a source that can draw on the device does so on a GPU (ResNet's synthetic images): no
        # host work per step and no copy; on the CPU the host is the device, read as before
        self.inputs_on_device = env.device.type != "cpu" and hasattr(source, "to")
        self.data = StepBatches(
            source.to(env.device) if self.inputs_on_device else source,
            cfg.train.global_batch_size,
            cfg.train.micro_batch_size,
            cfg.train.accumulate_steps,
            layout.data_rank(env.rank),
            layout.data_parallel_size,
        )
        self.memory = TensorPeak(env.device)
        moe = getattr(cfg.model, "moe", None)
        self.experts = (
            ExpertMonitor(
                self.model.parts,
                moe,
                cfg.model.num_layers,
                self.data.num_microbatches,
                env.device,
                env.world_size,
                counted=self.coords["mp"] == 0,
            )
            if moe is not None and moe.enabled
            else None
        )
        self._take_params()
        self.skipped = 0
        self.step = 0
        self._unread: list[_StepRecord] = []  # steps whose device values are not read yet
        self._offender: str | None = None  # this rank's non-finite gradient at the last reading step
        # the rank whose loss counts: one per data-parallel replica, on the last pipeline stage
        self.reports_loss = self.model.has_last and self.coords["mp"] == 0
        self._tokens_per_sample = family_of(cfg.model).tokens_per_sample(cfg.model)
        self.autocast = self._autocast_context()
        self.image_format = memory_format(cfg, env.device)
        self.scaler = torch.amp.GradScaler(env.device.type) if cfg.train.precision == "fp16" else None
        self.model.scaler = self.scaler
        if self.scaler is not None:
            # GradScaler creates its scale in the first scale() call, which pipeline stages without
            # the loss never make; their gradients arrive scaled by the last stage's (equal) scale.
            # It lives where the gradients do: offloaded ones are on the host, where GradScaler
            # would otherwise copy its inverse scale and overflow flag with non-blocking
            # device-to-host copies (pinned, asynchronous) that the host's unscale and fused step
            # read at once, before the copies land.
            self.scaler.scale(torch.ones((), device="cpu" if self.offloaded else env.device))

    def _take_params(self) -> None:
        """The parameters whose gradients the step norms and clips, by name (fault reports): the
        optimizers' choice (ZeRO-1: its fp32 master chunks, read again once it is built)."""
        self.named_params = self.optimizers.named_params()
        self.params = [p for _, p in self.named_params if p.requires_grad]

    def _build_optimizers(self) -> None:
        """Build what the optimizers allocate lazily (ZeRO-1: at the first step, so that the dry run
        allocates it on fake tensors)."""
        if self.optimizers.build():
            self._take_params()

    # ------------------------------------------------------------------------------------------------
    def _autocast_context(self):
        p = self.cfg.train.precision
        if (
            p == "fp32" or self.model.engine == Engine.FSDP
        ):  # FSDP casts parameters itself (MixedPrecisionPolicy)
            return contextlib.nullcontext
        return lambda: torch.autocast(self.env.device.type, dtype=DTYPES[p])

    def _loss_context(self):
        if self.layout.mp > 1 and self.model.spec.tp_plan is not None:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()  # cross entropy over vocabulary-sharded logits, forward and backward
        return contextlib.nullcontext()

    def forward_backward(self, step: int) -> torch.Tensor | None:
        """Run all micro-batches of the step; returns this rank's mean loss (None off the last stage)."""
        spec = self.model.spec
        if self.experts is not None:
            # the balance losses' gradient carries the loss's scale: a pipeline schedule's losses
            # are each back-propagated whole (the gradients divided by the micro-batches after),
            # here each is divided first; fp16 scales both
            scale = 1.0 if self.model.schedule is not None else 1.0 / self.data.num_microbatches
            self.experts.set_grad_scale(scale * (self.scaler.get_scale() if self.scaler is not None else 1.0))
        if self.model.schedule is not None:
            batch = self.data.whole(step)
            if self.model.sequence is not None:  # context parallel: the stages pass this rank's chunks
                batch = self.model.sequence.shard_batch(batch)
            args = [self._to_device(batch[k]) for k in spec.inputs] if self.model.has_first else []
            target = self._to_device(batch[spec.label]) if self.model.has_last else None
            losses: list[torch.Tensor] = []
            with self._loss_context(), self.autocast():
                # return_outputs=False: otherwise the last stage keeps every micro-batch's output
                # (the logits: n·b·s·v) alive until the step ends, only to merge them for us
                self.model.schedule.step(
                    *args, target=target, losses=losses if self.model.has_last else None, return_outputs=False
                )
            if not self.model.has_last:
                return None
            mean = torch.stack([_plain(x) for x in losses]).mean()
            # fp16: the schedule's losses are the scaled ones it back-propagated
            return mean / self.scaler.get_scale() if self.scaler is not None else mean

        (part,) = self.model.parts
        micro = self.data.each_microbatch(step) if self.inputs_on_device else self.data.microbatches(step)
        n = self.data.num_microbatches
        total = torch.zeros((), device=self.env.device)
        for i, mb in enumerate(micro):
            last = i == n - 1
            weight = None
            if self.model.sequence is not None:  # context parallel: this rank's chunks of each sequence
                whole, mb = mb, self.model.sequence.shard_batch(mb)
                # its share of the whole batch's mean loss (learned labels need not split evenly)
                mb[spec.label], weight = self.model.sequence.loss_weight(whole[spec.label], mb[spec.label])
            with self._sync_context(part, last), self._loss_context():
                with self.autocast():
                    # the output (a language model's logits) is not kept: bound to a name it would
                    # stay alive through the whole backward, which needs only what autograd saved
                    extra = {k: self._to_device(mb[k]) for k in spec.optional_inputs if k in mb}
                    loss = self.model.loss(
                        part(*[self._to_device(mb[k]) for k in spec.inputs], **extra),
                        self._to_device(mb[spec.label]),
                    )
                    if weight is not None:
                        loss = loss * self._to_device(weight)
                scaled = loss / n
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += _plain(loss)
        return total / n

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A batch tensor on the job's device; images in the model's memory format.

        A host tensor crosses through page-locked memory, without waiting: CUDA copies pageable
        memory through a staging buffer while the host waits for the stream, a host-device
        synchronization per input per micro-batch; from pinned memory the copy is queued on the
        stream (non_blocking) and the host goes on. The pinned buffer comes from torch's caching
        host allocator, which reuses it only once the copy is done."""
        fmt = self.image_format if t.dim() == 4 else torch.preserve_format
        device = self.env.device
        if t.device.type == "cpu" and device.type != "cpu":
            t = t.pin_memory().to(device, non_blocking=True)
        return t.to(device, memory_format=fmt)

    def _sync_context(self, part, last: bool):
        """Gradient accumulation without redundant communication: DDP all-reduces only on the last
        micro-batch; FSDP reduce-scatters every micro-batch (keeping gradients sharded, ZeRO-style)
        but all-reduces across dp replicas only on the last."""
        if self.model.engine == Engine.DDP:
            return contextlib.nullcontext() if last else part.no_sync()
        if self.model.engine == Engine.FSDP:
            part.set_requires_all_reduce(last)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> list[dict[str, float]]:
        """One optimizer step. Returns the metric records that became readable (rank 0; [] elsewhere):
        on a reading step (`reads_host`) one per step since the last one, else none.

        No host-device synchronization on the other steps: the loss, the gradient norm and the
        finite flag stay on the device until the next reading step, which reads them all at once,
        after its update, in one collective (torchtitan does the same). A non-finite gradient then
        stops training at the end of that reading step -- before any checkpoint, which only reading
        steps write -- naming the step where it happened (and, found in the step itself, the
        parameter). Exceptions that must decide within the step: fault.on_nonfinite=skip (whether to
        apply the update) and fp16 (torch's GradScaler reads its overflow flag in every step)."""
        self.model.train()
        timer = _StepTimer(self.env.device)
        reading = self.reads_host(step)
        self._build_optimizers()
        extra = [t for ts in self.optimizers.engine_tensors().values() for t in ts]
        with self.memory.measure(self.model.parts, self.optimizers.local(), self.model.stages, extra):
            loss = self.forward_backward(step)
            if self.experts is not None:
                self.experts.after_backward()  # load_balance=bias: the biases move here
            if self.model.expert_grads is not None:
                self.model.expert_grads.reduce()  # expert parallelism: over the ranks with the same experts
            self.optimizers.reduce_grads()  # ZeRO-1: reduce-scatter into the masters' .grad
            inject_fault(self.cfg.fault, self.env.rank, step, self.env.restart, self.named_params)
            if self.scaler:
                for opt in self.optimizers.optimizers:
                    self.scaler.unscale_(opt)
                self._agree_on_overflow()
            norm = self.optimizers.grad_norm(self.params, self.mesh, self.pp_group, self.env.device)
            lr = self.optimizers.lr
            skipped = False
            finite = None  # abort: this step's finite flag, checked by every rank at the next read
            if self.scaler is None:  # fp16's scaler skips non-finite steps by itself
                finite = torch.isfinite(norm).to(torch.float32).reshape(())
                if self.cfg.fault.on_nonfinite == "skip":
                    skipped, finite = not self._all_finite(finite), None
                elif reading:  # name this rank's offending parameter while its gradient exists
                    self._offender = None if bool(finite) else self._first_offender()
            if skipped:
                log.warning("%s; step skipped (fault.on_nonfinite=skip)", self._skipping(step, loss))
                self.optimizers.skip()
                self.skipped += 1
            else:
                if self.cfg.optim.grad_clip:
                    self.optimizers.clip_(self.params, self.cfg.optim.grad_clip, norm)
                self.optimizers.step(self.scaler)
                if self.scaler:
                    before = self.scaler.get_scale()
                    self.scaler.update()
                    if self.scaler.get_scale() < before:  # it found inf/NaN: skipped the step, backed off
                        self.skipped += 1
            self.optimizers.zero_grad()
        self._unread.append(
            _StepRecord(
                step,
                loss.detach() if (loss is not None and self.reports_loss) else None,
                norm.detach(),
                finite,
                lr,
                timer.stop(),
                time.time(),
                float(self.memory.peak),
                float(rss_peak_bytes()),
                float(self.memory.reserved),
                self.skipped,
            )
        )
        return self._read_records() if reading else []

    def reads_host(self, step: int) -> bool:
        """Whether step `step` reads the device (metrics, finite flags): a logging step, the first
        (the user sees the job alive and its initial loss at once), a checkpoint step (no checkpoint
        of weights that went non-finite unseen) and the last one."""
        t, ck = self.cfg.train, self.cfg.checkpoint
        return (
            step == 1
            or step % t.log_interval == 0
            or step >= t.steps
            or (ck.enabled and bool(ck.interval) and step % ck.interval == 0)
        )

    def _agree_on_overflow(self) -> None:
        """GradScaler decides per optimizer from the gradients it sees. DTensor reduces found_inf
        over a parameter's own mesh, but pipeline stages (and plain replicas) never compare: one
        MAX over the job makes every rank skip the step, and back off the scale, together."""
        if self.env.world_size == 1:
            return
        # torch keeps found_inf per optimizer and device here (its ShardedGradScaler reads it too)
        found = [v for opt in self.optimizers.optimizers for v in scaler_found_inf(self.scaler, opt)]
        flag = torch.zeros(1, device=self.env.device)
        for v in found:
            flag += v.to(self.env.device).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for v in found:
            v.copy_(flag.reshape(v.shape))

    def _all_finite(self, finite: torch.Tensor) -> bool:
        """fault.on_nonfinite=skip: whether every rank's gradients are finite, decided within the
        step (one all-reduce and one host read). The norm is already global for sharded and
        pipelined parameters, but replicated (DDP) gradients are reduced nowhere: a NaN on one rank
        alone must still make every rank skip, or they would take different paths and deadlock."""
        flag = finite.reshape(1)
        if self.env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return flag.item() >= 1

    def _first_offender(self) -> str | None:
        """The first of this rank's parameters whose gradient is non-finite (before zero_grad)."""
        return next(
            (
                name
                for name, p in self.named_params
                if p.grad is not None and not torch.isfinite(_local(p.grad)).all()
            ),
            None,
        )

    def _skipping(self, step: int, loss: torch.Tensor | None) -> str:
        """fault.on_nonfinite=skip: what is wrong with the step every rank is about to skip."""
        where = self._where(self._first_offender())
        note = " (the loss is non-finite too)" if loss is not None and not torch.isfinite(loss).all() else ""
        return f"non-finite gradient at step {step}: first offending {where}{note}"

    def _where(self, local: str | None) -> str:
        """The first offending parameter over all ranks, from each rank's own (a collective)."""
        names: list[tuple[int, str | None]] = [(self.env.rank, local)]
        if self.env.world_size > 1:
            names = [(0, None)] * self.env.world_size
            dist.all_gather_object(names, (self.env.rank, local))
        first = next(((r, n) for r, n in names if n is not None), None)
        return f"parameter {first[1]!r} on rank {first[0]}" if first else "an unknown parameter"

    def _non_finite(self, bad: int, steps: list[_StepRecord], table: torch.Tensor) -> FloatingPointError:
        """fault.on_nonfinite=abort: the error every rank raises, alike, after reading that step
        `steps[bad]` had a non-finite gradient on some rank (table: [rank, step, column])."""
        step, found = steps[bad].step, steps[-1].step
        losses = table[:, bad, _LOSS][table[:, bad, _REPORTS] > 0]
        loss_note = " (the loss is non-finite too)" if not torch.isfinite(losses).all() else ""
        if step == found:  # every rank searched its own gradients in the step
            where = f": first offending {self._where(self._offender)}"
        else:
            where = (
                f" (found at step {found}: train.log_interval={self.cfg.train.log_interval} reads the "
                f"device every {self.cfg.train.log_interval} steps; with train.log_interval=1 training "
                "stops at the end of the step and names the first offending parameter)"
            )
        return FloatingPointError(
            f"non-finite gradient at step {step}{where}{loss_note}; set fault.on_nonfinite=skip to skip such steps"
        )

    def _read_records(self) -> list[dict[str, float]]:
        """The metric records of the steps since the last read: one small matrix per rank (a row
        per step: _COLUMNS) gathered on every rank in one collective and read to the host in one
        copy. Every rank sees every finite flag, so all stop together at a non-finite gradient
        (fault.on_nonfinite=abort): rank 0 records the steps up to it, and every rank raises."""
        steps, self._unread = self._unread, []
        if not steps:  # (every rank has the same steps unread)
            return []
        device = self.env.device
        zero, one = torch.zeros((), device=device), torch.ones((), device=device)
        on_device = torch.stack(
            [
                torch.stack(
                    [
                        r.loss.float() if r.loss is not None else zero,
                        r.norm.float().reshape(()),
                        r.finite if r.finite is not None else one,
                    ]
                )
                for r in steps
            ]
        ).to(torch.float64)
        on_host = torch.tensor(
            [[1.0 if r.loss is not None else 0.0, r.elapsed(), r.peak, r.rss, r.reserved] for r in steps],
            dtype=torch.float64,
        )
        mine = torch.cat([on_device, on_host.to(device)], dim=1)  # NCCL gathers only device tensors
        world = self.env.world_size
        rows = [mine]
        if world > 1:
            rows = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()  # [rank, step, column]: one device-to-host copy
        # reduced over ranks for all the steps at once, then read in one call (a row per step): a
        # few tensor ops per read, not a dozen per step (the dry run's fake tensors read 1.0 each)
        reduced = torch.stack(
            [
                table[:, :, _FINITE].amin(0),  # 1.0 where every rank's gradients were finite
                table[:, :, _LOSS].sum(0) / table[:, :, _REPORTS].sum(0),
                table[0, :, _NORM],  # the global norm (rank 0's copy)
                table[:, :, _TIME].amax(0),  # the slowest rank's step
                table[:, :, _PEAK].amax(0),
                table[:, :, _PEAK].mean(0),
                table[:, :, _RSS].amax(0),
                table[:, :, _RESERVED].amax(0),
            ],
            dim=1,
        ).tolist()
        bad = next((i for i, row in enumerate(reduced) if row[0] < 1), None)
        experts = self.experts.read() if self.experts is not None else [{}] * len(steps)  # (a collective)
        records = (
            []
            if self.env.rank != 0
            else [{**self._metrics(r, reduced[i]), **experts[i]} for i, r in enumerate(steps)]
        )
        if bad is not None:
            self._append(records[: bad + 1])
            raise self._non_finite(bad, steps, table)
        return records

    def _metrics(self, r: _StepRecord, reduced: list[float]) -> dict[str, float]:
        """One step's record from its row reduced over ranks (see _read_records)."""
        _, loss, norm, step_time, peak_max, peak_mean, rss_max, reserved_max = reduced
        plan, cfg, world = self.plan, self.cfg, self.env.world_size
        samples = cfg.train.global_batch_size / step_time
        tokens_per_sample = self._tokens_per_sample
        metrics = {
            "step": r.step,
            "time": r.ended,  # when the step ended (the tracker's timestamp if delivery is late)
            Metric.LOSS: loss,
            Metric.LR: r.lr,
            Metric.GRAD_NORM: norm,
            Metric.STEP_TIME: step_time,
            Metric.SAMPLES_PER_S: samples,
            Metric.TOKENS_PER_S: samples * tokens_per_sample,
            Metric.TFLOPS_PER_DEVICE: plan.flops_per_step / step_time / world / 1e12,
            Metric.MFU: plan.flops_per_step / (step_time * world * plan.device_peak_flops),
            Metric.PEAK_BYTES_MAX: peak_max,
            Metric.PEAK_BYTES_MEAN: peak_mean,
            Metric.RSS_PEAK_BYTES_MAX: rss_max,
            Metric.PREDICTED_BYTES: float(plan.memory_bytes["total"]),
            Metric.RESERVED_BYTES_MAX: reserved_max,
            Metric.SKIPPED_STEPS: float(r.skipped),
            Metric.ATTEMPT: float(self.env.restart),
            Metric.WORLD_SIZE: float(world),
        }
        if not tokens_per_sample:  # not a token model
            metrics.pop(Metric.TOKENS_PER_S)
        if self.env.device.type != "cuda":  # no caching allocator: nothing reserved beyond tensors
            metrics.pop(Metric.RESERVED_BYTES_MAX)
        if self.scaler is not None:
            metrics[Metric.LOSS_SCALE] = self.scaler.get_scale()
        return metrics

    # ------------------------------------------------------------------------------------------------
    # --- Stateful: what a checkpoint holds; runtime/checkpoint.py saves and loads it -------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state under layout-independent names: `model.<param>` (its shards, under
        the model's own names), `state.<param>.<key>` (the optimizer state it holds), the step
        (which is also the data position and the LR schedule's), its RNG stream and fp16's loss
        scale (`amp.*`)."""
        self._build_optimizers()
        return {
            **self.optimizers.model_state(),  # ZeRO-1: the fp32 masters, sharded
            **self.optimizers.optimizer_state(),
            "train.step": torch.tensor(self.step),
            "train.skipped": torch.tensor(self.skipped),
            **checkpoint.rng_state(self.env.rank, self.env.device),
            **checkpoint.scaler_state(self.scaler),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take back a state that DCP loaded in place (optimizer state is already in place;
        ZeRO-1's masters too: the working weights are gathered from them)."""
        self.optimizers.load_model_state(state)  # ZeRO-1: working weights gathered from the masters
        if checkpoint.RNG_KEY.format(rank=self.env.rank) in state:  # same ranks as the checkpoint's
            checkpoint.set_rng_state(state, self.env.rank, self.env.device)
        self.step = int(state["train.step"])
        self.skipped = int(state["train.skipped"])
        checkpoint.set_scaler_state(self.scaler, state)
        self.optimizers.restore_schedule(self.step)

    def resume(self, path: Path) -> None:
        started = time.perf_counter()
        checkpoint.load(path, self, self.cfg)
        log.info("resumed from %s at step %d in %.2f s", path, self.step, time.perf_counter() - started)

    def save(self) -> None:
        started = time.perf_counter()
        ck = self.cfg.checkpoint
        path = checkpoint.save(self.run_dir, self.step, self, self.cfg, self.layout, keep=ck.keep)
        if self.env.rank == 0:
            log.info("checkpoint %s written in %.2f s", path.name, time.perf_counter() - started)

    def _append(self, records: list[dict[str, float]]) -> None:
        """rank 0, on reading steps: one metrics.jsonl line per step since the last reading step."""
        for metrics in records:
            append_record(self.run_dir, metrics)

    def fit(self) -> None:
        steps, ck = self.cfg.train.steps, self.cfg.checkpoint
        while self.step < steps:
            step = self.step + 1
            records = self.train_step(step)  # a non-finite gradient raises, on every rank, at a read
            self.step = step
            self._append(records)
            if step == 1 and self.model.stages:
                log.info(
                    "pipeline receive buffers (sets made, of %d micro-batches): %s",
                    self.cfg.train.accumulate_steps,
                    "; ".join(f"chunk {st.stage_index}: {st.buffer_sets()}" for st in self.model.stages),
                )
            if step == 1 and self.cfg.train.compile:
                counters = compile_counters()
                # a test reads this line: compiled graphs > 0 proves the blocks did not run eagerly
                log.info(
                    "torch.compile: %d graph(s) compiled for the blocks, %d graph break(s)",
                    counters["stats"]["unique_graphs"],
                    sum(counters["graph_break"].values()),
                )
            if records:
                log.info(format_step(records[-1], steps))
            if ck.enabled and (step == steps or (ck.interval and step % ck.interval == 0)):
                self.save()
        tracking = self.cfg.tracking
        if tracking.enabled and tracking.log_model and not ck.enabled:
            # the launcher logs the model from these shards (with checkpoints on, the last one has them)
            from fleetwise.runtime import checkpoint

            checkpoint.save_model(self.run_dir, self.model.parts)


@dataclass
class _StepRecord:
    """What a step leaves for the next reading step: device tensors, not yet read, and host values."""

    step: int
    loss: torch.Tensor | None  # this rank's mean loss, where it counts (see reports_loss)
    norm: torch.Tensor  # the global gradient norm
    finite: torch.Tensor | None  # whether this rank's gradients were finite (None: decided in the step)
    lr: float
    elapsed: Callable[[], float]  # the step's time in seconds (CUDA: read at the reading step)
    ended: float  # wall-clock time.time() at the step's end (host)
    peak: float
    rss: float
    reserved: float
    skipped: int  # skipped steps so far


class _StepTimer:
    """A step's duration without synchronizing: on CUDA a pair of events on the stream, read (after
    the step's work) at the next reading step; elsewhere ops are synchronous and the host clock is
    the step's time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        self.start = time.perf_counter()

    def stop(self) -> Callable[[], float]:
        if self.cuda:
            self.end_event.record()
            start, end = self.start_event, self.end_event

            def elapsed() -> float:
                end.synchronize()
                return start.elapsed_time(end) / 1e3

            return elapsed
        seconds = time.perf_counter() - self.start
        return lambda: seconds


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached local scalar (a vocabulary-parallel loss is a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).float()


def format_step(m: dict[str, float], steps: int) -> str:
    """nanoGPT-style: the numbers a user wants, nothing else."""
    rate = (
        f"{m[Metric.TOKENS_PER_S]:,.0f} tok/s"
        if Metric.TOKENS_PER_S in m
        else f"{m[Metric.SAMPLES_PER_S]:,.1f} samples/s"
    )
    return (
        f"step {m['step']}/{steps} | loss {m[Metric.LOSS]:.4f} | {m[Metric.STEP_TIME] * 1e3:.0f} ms | {rate}"
        f" | mfu {m[Metric.MFU]:.1%} | mem {m[Metric.PEAK_BYTES_MAX] / 2**20:.1f} MiB"
        f" (plan {m[Metric.PREDICTED_BYTES] / 2**20:.1f} MiB)"
    )
