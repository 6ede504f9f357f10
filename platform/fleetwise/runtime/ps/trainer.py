"""A parameter-server trainer: prefetch, compute, push; trainer 0 also aggregates the metrics.

One step of trainer t (step k from 0):
1. data: its contiguous slice of the global batch k, in accumulate_steps micro-batches.
2. prefetch: the distinct ids of all its micro-batches, per distributed table, split by owning
   server (id mod S), are requested from each server at once; the reply holds the server's dense
   blocks and exactly those rows. The trainer never holds a distributed table. Async mode pulls at
   the start of the step; sync mode gets the values with the previous step's commit reply.
3. compute: forward/backward of each micro-batch on the pulled values (`CTRNet.forward_rows`),
   loss / accumulate_steps, so gradients are the mean over the trainer's samples.
4. push: each server gets its dense blocks' gradients and its rows' gradients (same ids as the
   prefetch). sync: stage, then commit with the global-norm clipping factor (see server.py);
   async: applied on arrival, clipped by this trainer's own gradient norm.

Metrics: every trainer sends one record per step to trainer 0 (fire-and-forget RPC); trainer 0
writes a metrics.jsonl line for step k once all trainers' records of step k are in:
- train/loss, ps/*_latency_s, ps/wait_s, ps/compute_s, ps/staleness: means over trainers;
- ps/bytes_pulled, ps/bytes_pushed, ps/{dense,sparse}_bytes_pulled, ps/sparse_rows_pulled: sums
  over trainers (bytes of tensor payload; pushed counts gradients plus the row ids sent);
- perf/step_time_s: the slowest trainer's; perf/samples_per_s: each trainer's own samples/s,
  summed (in async mode a slowed trainer lowers only its own share); ..._per_trainer: the mean;
- ps/pull_latency_s: the round trip that brought the step's values (sync: the previous commit,
  apply included); ps/push_latency_s: the gradient round trip without ps/wait_s (time held at the
  sync barrier or by max_staleness);
- memory/server_bytes_max: parameters + optimizer state of the fullest server shard (the plan's
  server_bytes); memory/peak_bytes_max/_mean: peak live tensor bytes over all processes (a
  server: its state plus the most gradient bytes it held; a trainer: counted on its first two
  steps); memory/rss_peak_bytes_max: peak RSS of any process; memory/predicted_bytes: the plan's;
- perf/tflops_per_device, perf/mfu: the planner's model FLOPs per step over the step time, per
  trainer (servers do no model FLOPs).

Test hooks: FLEETWISE_PS_SLOW="T:SECONDS[,T:SECONDS]" makes trainer T sleep that long every step;
`fault.kill_rank`/`fault.at_step`/`fault.mode` make a trainer die in the middle of its push (after
its gradients reached server 0 only).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc

# The server module itself (its functions are RPC targets), not through the package `runtime.ps`,
# whose `run` imports this file: that would be an import cycle between the two.
import fleetwise.runtime.ps.server as srv
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.families.ctr.data import SyntheticClicks, rank_micro_batches
from fleetwise.families.ctr.model import CTRNet, ctr_loss
from fleetwise.families.ctr.schema import CTRModel
from fleetwise.plan.ps import placement
from fleetwise.plan.records import Plan
from fleetwise.rundir import PS_SUMMARY_FILE, Metric, append_record, metrics_path
from fleetwise.runtime.memory import LiveTensorBytes
from fleetwise.runtime.ps.optim import clip_coefficient, lr_at
from fleetwise.runtime.ps.roles import Role, init_rpc, log, peak_rss_bytes, server_name, trainer_name
from fleetwise.runtime.ps.wire import ShardLayout

SLOW_ENV = "FLEETWISE_PS_SLOW"


def slow_seconds(trainer: int) -> float:
    """Test hook: the per-step delay FLEETWISE_PS_SLOW asks of this trainer."""
    for part in filter(None, os.environ.get(SLOW_ENV, "").split(",")):
        t, _, sec = part.partition(":")
        if int(t) == trainer:
            return float(sec)
    return 0.0


Call = Callable[[int, str, tuple], Any]  # (server index, "pull"|"push"|"commit", args) -> has .wait()


def rpc_call(server: int, method: str, args: tuple) -> Any:
    return rpc.rpc_async(server_name(server), getattr(srv, method), args=args)


@dataclass
class _Prepared:
    k: int
    batches: list[dict[str, torch.Tensor]]
    uniq: dict[str, torch.Tensor]  # distinct ids per distributed table
    inverse: dict[str, list[torch.Tensor]]  # per micro-batch: position of each id in uniq
    owner: dict[str, torch.Tensor]  # server of each distinct id
    requests: list[tuple[torch.Tensor, list[int]]]  # packed ids per server


class Trainer:
    """`call` sends one request to a server; RPC by default, a direct call in unit tests."""

    def __init__(self, cfg: RunConfig, role: Role, call: Call = rpc_call) -> None:
        s, m = cfg.strategy, cfg.model
        assert isinstance(s, PSStrategy) and isinstance(m, CTRModel)
        self.cfg, self.s, self.role, self.t = cfg, s, role, role.index
        self.place = placement(cfg)
        self.model = CTRNet(m, seed=cfg.train.seed, remote_tables=True)
        self.params = dict(self.model.named_parameters())
        self.remote = {t.name: t for t in self.place.tables}  # distributed tables, by name
        self.data = SyntheticClicks(m, cfg.data)
        self.delay = slow_seconds(self.t)
        self.call = call
        self.layouts = [ShardLayout.of(self.place, s) for s in range(self.s.num_servers)]
        self.dense_numel = sum(b.numel for b in self.place.dense)
        self.tensor_peak = 0
        self._next: _Prepared | None = None  # step k+1, prepared for the prefetch
        self._values: tuple[list[torch.Tensor], float, float] | None = None  # (values, pull_s, wait_s)

    # -------------------------------------------------------------- one step

    def prepare(self, k: int) -> _Prepared:
        """Step k's micro-batches and its prefetch request: the distinct ids of all of them per
        distributed table, grouped by owning server (id mod S)."""
        cfg, S = self.cfg, self.s.num_servers
        micro = rank_micro_batches(
            k,
            self.t,
            self.s.num_trainers,
            cfg.train.global_batch_size,
            cfg.train.micro_batch_size,
            cfg.data.num_samples,
        )
        batches = [self.data.batch(ix) for ix in micro]
        uniq: dict[str, torch.Tensor] = {}
        inverse: dict[str, list[torch.Tensor]] = {}
        for name, table in self.remote.items():
            col = torch.cat([b["sparse_ids"][:, table.field] for b in batches])
            u, inv = torch.unique(col, return_inverse=True)
            uniq[name] = u
            inverse[name] = list(inv.split([len(b["labels"]) for b in batches]))
        owner = {n: u % S for n, u in uniq.items()}
        requests = [
            self.layouts[s].pack_ids({n: u[owner[n] == s] for n, u in uniq.items()}) for s in range(S)
        ]
        return _Prepared(k, batches, uniq, inverse, owner, requests)

    def step(self, k: int) -> dict[str, Any]:
        """One optimizer step; the first two also count this trainer's live tensor bytes (the
        second is the first with the values of a full step in flight: the steady peak)."""
        if k >= 2:
            rec = self._step(k)
        else:
            tracker = LiveTensorBytes(list(self.params.values()))
            with tracker:
                rec = self._step(k)
            self.tensor_peak = max(self.tensor_peak, tracker.peak)
        rec["peak_tensor"] = [self.tensor_peak, *rec["peak_tensor"]]
        return rec

    def _step(self, k: int) -> dict[str, Any]:
        cfg, S = self.cfg, self.s.num_servers
        t_start = time.perf_counter()
        prep = self._next if self._next is not None and self._next.k == k else self.prepare(k)
        self._next = None

        # values: prefetched by the previous step's commit (sync), else one pull per server
        if self._values is not None:
            values, pull_s, pull_wait = self._values
            self._values = None
        else:
            t0 = time.perf_counter()
            futs = [self.call(s, "pull", (k, self.t, *prep.requests[s])) for s in range(S)]
            replies = [f.wait() for f in futs]
            values = [r["values"] for r in replies]
            pull_wait = max(r["wait_s"] for r in replies)
            pull_s = time.perf_counter() - t0 - pull_wait
        rows = self._assemble(prep, values)

        # compute
        t1 = time.perf_counter()
        for p in self.params.values():
            p.grad = None
        loss_sum = 0.0
        n_micro = len(prep.batches)
        for j, b in enumerate(prep.batches):
            emb, first = self._lookup(b["sparse_ids"], rows, {n: inv[j] for n, inv in prep.inverse.items()})
            loss = ctr_loss(self.model.forward_rows(emb, first, b["dense"]), b["labels"])
            (loss / n_micro).backward()
            loss_sum += float(loss.detach())
        if self.delay:
            time.sleep(self.delay)
        compute_s = time.perf_counter() - t1
        dense_grads = {n: self.params[n].grad for n in self.place.dense_names}
        row_grads = {n: r.grad for n, r in rows.items()}
        local_sq = sum(float(g.double().pow(2).sum()) for g in [*dense_grads.values(), *row_grads.values()])
        if not math.isfinite(local_sq):
            raise FloatingPointError(
                f"non-finite gradient on trainer {self.t} at step {k + 1} (loss {loss_sum / n_micro:.4g}); "
                "nothing was pushed. Lower optim.lr or set optim.grad_clip"
            )
        grad_norm = math.sqrt(local_sq)

        # push (async: clipped by this trainer's own gradient norm)
        t2 = time.perf_counter()
        scale = clip_coefficient(grad_norm, cfg.optim.grad_clip) if self.s.mode == "async" else 1.0
        messages = []
        for s in range(S):
            dense = {b.key: dense_grads[b.name][b.row_start : b.row_stop] for b in self.place.blocks_on(s)}
            sparse = {n: row_grads[n][prep.owner[n] == s] for n in rows}
            grads = self.layouts[s].pack(dense, sparse)  # a new tensor (torch.cat), never a view
            messages.append((grads * scale if scale != 1.0 else grads, *prep.requests[s]))
        self._maybe_fault(k, messages)
        futs = [self.call(s, "push", (k, self.t, *messages[s])) for s in range(S)]
        acks = [f.wait() for f in futs]
        wait_s = max(a["wait_s"] for a in acks)
        push_s = time.perf_counter() - t2 - wait_s
        if self.s.mode == "sync":
            # phase 2: commit with the global clipping factor; the reply prefetches step k+1
            grad_norm = math.sqrt(sum(a["sqnorm"] for a in acks))
            scale = clip_coefficient(grad_norm, cfg.optim.grad_clip)
            nxt = self.prepare(k + 1) if k + 1 < cfg.train.steps else None
            t3 = time.perf_counter()
            futs = [
                self.call(s, "commit", (k, scale, *(nxt.requests[s] if nxt else (None, None))))
                for s in range(S)
            ]
            acks = [f.wait() for f in futs]
            if nxt is not None:
                self._next = nxt
                self._values = ([a["values"] for a in acks], time.perf_counter() - t3, 0.0)
        step_s = time.perf_counter() - t_start

        ids_sent = sum(len(u) for u in prep.uniq.values())
        sparse_pulled = 4 * sum(r.numel() for r in rows.values())
        return {
            "step": k,
            "trainer": self.t,
            "loss": loss_sum / n_micro,
            "samples": sum(len(b["labels"]) for b in prep.batches),
            "step_time_s": step_s,
            "compute_s": compute_s,
            "pull_s": pull_s,
            "push_s": push_s,
            "wait_s": wait_s + pull_wait,
            "bytes_pulled": 4 * self.dense_numel + sparse_pulled,
            "dense_bytes_pulled": 4 * self.dense_numel,
            "sparse_bytes_pulled": sparse_pulled,
            # gradients and their row ids, plus the ids of the prefetch request
            "bytes_pushed": srv._nbytes(messages) + 8 * ids_sent,
            "sparse_rows_pulled": ids_sent,
            "grad_norm": grad_norm,
            "staleness": sum(a.get("staleness", 0) for a in acks) / len(acks),
            "server_bytes": [a["server_bytes"] for a in acks],
            # peaks of this trainer and of each server (as of their last reply)
            "peak_rss": [peak_rss_bytes(), *(a["peak_rss"] for a in acks)],
            "peak_tensor": [a["peak_tensor_bytes"] for a in acks],  # step() puts the trainer's first
        }

    def _assemble(self, prep: _Prepared, values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy the pulled dense blocks into the model; return the pulled rows per table as leaf
        tensors that collect the rows' gradients."""
        blocks: dict[str, torch.Tensor] = {}
        pulled: list[dict[str, torch.Tensor]] = []
        for s, v in enumerate(values):
            dense, got = self.layouts[s].unpack(v, prep.requests[s][1])
            blocks.update(dense)
            pulled.append(got)
        with torch.no_grad():
            for name in self.place.dense_names:
                parts = sorted((b for b in self.place.dense if b.name == name), key=lambda b: b.index)
                self.params[name].copy_(torch.cat([blocks[b.key] for b in parts]))
        rows: dict[str, torch.Tensor] = {}
        for name, u in prep.uniq.items():
            r = torch.empty(len(u), self.remote[name].width)
            for s in range(self.s.num_servers):
                r[prep.owner[name] == s] = pulled[s][name]
            rows[name] = r.requires_grad_(True)
        return rows

    def _lookup(
        self, ids: torch.Tensor, rows: dict[str, torch.Tensor], inv: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, F, k] embeddings and [B, F] first-order weights: pulled rows for distributed tables,
        the (pulled dense) local tables for the others."""
        k = self.cfg.model.embedding_dim
        embs, firsts = [], []
        for f, name in enumerate(self.model.fields):
            if name in rows:
                r = rows[name][inv[name]]
                embs.append(r[:, :k])
                firsts.append(r[:, k])
            else:
                embs.append(self.model.embeddings[name](ids[:, f]))
                firsts.append(self.model.first_order[name](ids[:, f]).squeeze(-1))
        return torch.stack(embs, 1), torch.stack(firsts, 1)

    def _maybe_fault(self, k: int, messages: list[Any]) -> None:
        f = self.cfg.fault
        if f.kill_rank != self.role.rank or f.at_step != k + 1:
            return
        # Die mid-push: the gradients reach server 0 only. Sync servers must not apply them.
        log(self.role, f"fault hook: pushing step {k + 1} to server 0 only, then failing ({f.mode})")
        self.call(0, "push", (k, self.t, *messages[0]))
        time.sleep(1.0)
        if f.mode == "raise":
            raise RuntimeError(f"fault injected on trainer {self.t} at step {k + 1}")
        if f.mode == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------- metrics on trainer 0


class MetricsSink:
    """Collects every trainer's per-step records on trainer 0 and writes metrics.jsonl in order."""

    def __init__(self, cfg: RunConfig, plan: Plan, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        s = cfg.strategy
        assert isinstance(s, PSStrategy)
        self.n = s.num_trainers
        self.records: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        self.finals: dict[int, dict[str, Any]] = {}
        self.next = 0
        self.cond = threading.Condition()
        self.path = metrics_path(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.lines: list[dict[str, Any]] = []
        # MFU as the planner defines it: model FLOPs of a step over trainers × peak
        self.flops_per_step = plan.flops_per_step
        self.predicted_bytes = plan.memory_bytes["total"]  # the worst process: fullest server or a trainer
        self.peak_flops = cfg.hardware.peak_flops(cfg.train.precision)

    def add(self, rec: dict[str, Any]) -> None:
        with self.cond:
            self.records[rec["step"]][rec["trainer"]] = rec
            self.cond.notify_all()

    def add_final(self, trainer: int, summary: dict[str, Any]) -> None:
        with self.cond:
            self.finals[trainer] = summary
            self.cond.notify_all()

    def flush(self, role: Role) -> None:
        """Write the lines of every step all trainers have reported, in step order."""
        while True:
            with self.cond:
                recs = self.records.get(self.next)
                if recs is None or len(recs) < self.n:
                    return
                del self.records[self.next]
                self.next += 1
            line = self._line(self.next - 1, [recs[t] for t in sorted(recs)])
            self.lines.append(line)
            append_record(self.run_dir, line)
            if line["step"] in (1, self.cfg.train.steps) or line["step"] % self.cfg.train.log_interval == 0:
                log(
                    role,
                    f"step {line['step']}/{self.cfg.train.steps}: loss {line[Metric.LOSS]:.4f}, "
                    f"{line[Metric.STEP_TIME] * 1e3:.1f} ms, {line[Metric.SAMPLES_PER_S]:.0f} samples/s, "
                    f"pull {line[Metric.PS_PULL_LATENCY] * 1e3:.2f} ms, push {line[Metric.PS_PUSH_LATENCY] * 1e3:.2f} "
                    f"ms, wait {line[Metric.PS_WAIT] * 1e3:.2f} ms, {line[Metric.PS_SPARSE_ROWS_PULLED]} rows",
                )

    def _line(self, k: int, recs: list[dict[str, Any]]) -> dict[str, Any]:
        def mean(key: str) -> float:
            return sum(r[key] for r in recs) / len(recs)

        def total(key: str) -> float:
            return sum(r[key] for r in recs)

        rates = [r["samples"] / r["step_time_s"] for r in recs]
        server_bytes = [b for r in recs for b in r["server_bytes"]]

        # one peak per process: each trainer's own, each server's latest
        def per_process(key: str) -> list[int]:
            servers = [max(r[key][1 + i] for r in recs) for i in range(len(recs[0][key]) - 1)]
            return [r[key][0] for r in recs] + servers

        peaks, rss = per_process("peak_tensor"), per_process("peak_rss")
        step_time = max(r["step_time_s"] for r in recs)
        tflops = self.flops_per_step / step_time / len(recs) / 1e12  # model FLOPs per trainer
        return {
            "step": k + 1,
            Metric.LOSS: mean("loss"),
            Metric.LR: lr_at(self.cfg, k),
            Metric.GRAD_NORM: mean("grad_norm"),
            Metric.STEP_TIME: step_time,
            Metric.SAMPLES_PER_S: sum(rates),
            Metric.SAMPLES_PER_S_PER_TRAINER: sum(rates) / len(rates),
            Metric.PS_PULL_LATENCY: mean("pull_s"),
            Metric.PS_PUSH_LATENCY: mean("push_s"),
            Metric.PS_WAIT: mean("wait_s"),
            Metric.PS_COMPUTE: mean("compute_s"),
            Metric.PS_BYTES_PULLED: int(total("bytes_pulled")),
            Metric.PS_BYTES_PUSHED: int(total("bytes_pushed")),
            Metric.PS_DENSE_BYTES_PULLED: int(total("dense_bytes_pulled")),
            Metric.PS_SPARSE_BYTES_PULLED: int(total("sparse_bytes_pulled")),
            Metric.PS_SPARSE_ROWS_PULLED: int(total("sparse_rows_pulled")),
            Metric.PS_STALENESS: mean("staleness"),
            Metric.TFLOPS_PER_DEVICE: tflops,
            Metric.MFU: tflops * 1e12 / self.peak_flops,
            Metric.SERVER_BYTES_MAX: max(server_bytes),
            Metric.PEAK_BYTES_MAX: max(peaks),
            Metric.PEAK_BYTES_MEAN: sum(peaks) / len(peaks),
            Metric.RSS_PEAK_BYTES_MAX: max(rss),
            Metric.PREDICTED_BYTES: self.predicted_bytes,
        }


_sink: MetricsSink | None = None


def report(rec: dict[str, Any]) -> None:
    assert _sink is not None
    _sink.add(rec)


def report_final(trainer: int, summary: dict[str, Any]) -> None:
    assert _sink is not None
    _sink.add_final(trainer, summary)


# ---------------------------------------------------------------------- process entry


def train(cfg: RunConfig, plan: Plan, role: Role, run_dir: Path) -> None:
    global _sink
    s = cfg.strategy
    assert isinstance(s, PSStrategy)
    if role.index == 0:
        _sink = MetricsSink(cfg, plan, run_dir)  # before init_rpc: other trainers report right away
    trainer = Trainer(cfg, role)
    init_s = init_rpc(cfg, role)
    log(role, f"init_rpc {init_s:.3f} s; {cfg.train.steps} steps, mode {s.mode}, delay {trainer.delay} s")
    t_begin = time.perf_counter()
    pending = []
    samples = 0
    for k in range(cfg.train.steps):
        rec = trainer.step(k)
        samples += rec["samples"]
        if role.index == 0:
            report(rec)
            _sink.flush(role)  # type: ignore[union-attr]
        else:
            pending.append(rpc.rpc_async(trainer_name(0), report, args=(rec,)))
    train_s = time.perf_counter() - t_begin
    final = {
        "trainer": role.index,
        "rank": role.rank,
        "pid": os.getpid(),
        "init_rpc_s": init_s,
        "train_time_s": train_s,
        "samples": samples,
        "samples_per_s": samples / train_s,
    }
    # no rate here: the job's throughput is the launcher's summary (steady steps), one figure
    log(role, f"done: {samples} samples in {train_s:.2f} s")
    for f in pending:
        f.wait()
    if role.index == 0:
        report_final(0, final)
        _finish_metrics(cfg, role, run_dir)
    else:
        rpc.rpc_sync(trainer_name(0), report_final, args=(role.index, final))
    for srv_index in range(s.num_servers):
        rpc.rpc_sync(server_name(srv_index), srv.trainer_finished, args=(role.index,))
    rpc.shutdown()


def _mean(lines: list[dict[str, Any]], key: str) -> float:
    return sum(x[key] for x in lines) / max(1, len(lines))


def _finish_metrics(cfg: RunConfig, role: Role, run_dir: Path) -> None:
    """Trainer 0, after its last step: wait for the others' records, write the rest of
    metrics.jsonl and ps_summary.json (per trainer and per server totals)."""
    assert _sink is not None
    s = cfg.strategy
    assert isinstance(s, PSStrategy)
    deadline = time.monotonic() + cfg.launch.collective_timeout_s
    while True:
        _sink.flush(role)
        with _sink.cond:
            complete = _sink.next >= cfg.train.steps and len(_sink.finals) == s.num_trainers
            if not complete:
                _sink.cond.wait(0.5)
        if complete:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the other trainers' metrics did not arrive")
    servers = [rpc.rpc_sync(server_name(i), srv.info) for i in range(s.num_servers)]
    place = placement(cfg)
    trainers = [_sink.finals[t] for t in range(s.num_trainers)]
    inits = [t["init_rpc_s"] for t in trainers] + [v["init_rpc_s"] for v in servers]
    lines = _sink.lines
    skip = min(cfg.train.warmup_steps_excluded, max(0, len(lines) - 1))
    steady = lines[skip:]
    summary = {
        "mode": s.mode,
        "dispatch": s.dispatch,
        "role_mapping": {
            "trainers": list(range(s.num_trainers)),
            "servers": list(range(s.num_trainers, s.num_trainers + s.num_servers)),
        },
        "trainers": trainers,
        "servers": servers,
        # init_rpc returns once every rank has joined: the rank that arrived last (min) measures
        # init_rpc itself, the others add the wait for slower starters (max)
        "init_rpc_s_min": min(inits),
        "init_rpc_s_max": max(inits),
        # the job's rate: each trainer's own rate summed (a slowed trainer only lowers its own share)
        "samples_per_s": sum(t["samples_per_s"] for t in trainers),
        "steady": {
            "steps": len(steady),
            "step_time_s_mean": _mean(steady, Metric.STEP_TIME),
            "samples_per_s_mean": _mean(steady, Metric.SAMPLES_PER_S),
            "pull_latency_s_mean": _mean(steady, Metric.PS_PULL_LATENCY),
            "push_latency_s_mean": _mean(steady, Metric.PS_PUSH_LATENCY),
            "wait_s_mean": _mean(steady, Metric.PS_WAIT),
        },
        "sparse_table_bytes": 4 * sum(t.num_rows * t.width for t in place.tables),
        "sparse_bytes_pulled_per_step_mean": sum(x[Metric.PS_SPARSE_BYTES_PULLED] for x in lines)
        / max(1, len(lines)),
        "server_bytes": [v["state_bytes"] for v in servers],
        "server_bytes_planned": [place.server_bytes(i) for i in range(s.num_servers)],
        "first_loss": lines[0][Metric.LOSS] if lines else None,
        "last_loss": lines[-1][Metric.LOSS] if lines else None,
    }
    (run_dir / PS_SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    log(role, f"{PS_SUMMARY_FILE} written: server shards {summary['server_bytes']} bytes")
