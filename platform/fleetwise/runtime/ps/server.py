"""A parameter server: holds its shard of the dense blocks and of the distributed sparse tables,
answers pulls and applies pushed gradients with the server-side optimizers.

Protocol (module-level RPC functions below, called by trainers through TensorPipe; values, ids
and gradients travel packed, see wire.py):

- `pull(step, trainer, ids)` -> values of this server's dense blocks and of the requested rows
  (global ids this server owns). In async mode with `max_staleness`, the answer is held back while
  the trainer is more than max_staleness steps ahead of the slowest unfinished trainer.
- sync, two phases per step:
  1. `push(step, trainer, grads, ids)` stages the trainer's gradients; the reply comes when every
     trainer has staged (the barrier) and carries the squared norm of this server's averaged
     gradient (for global-norm clipping) and how long the trainer waited.
  2. `commit(step, clip, next_ids)` applies the averaged gradient (the first commit of a step
     applies it, the others find it applied) and returns the values of the trainer's next step
     (the prefetch: no separate pull). A trainer commits only after every server acknowledged
     phase 1, so a step is applied on all servers or on none: a trainer that dies mid-push leaves
     every server at the previous step.
- async: `push` applies the trainer's gradient on arrival; the trainer pulls before each step.

Every mutation and every read of parameters happens under one lock, and a push is checked (sizes,
row ownership, duplicates, finite values) before anything is staged: a malformed or partial push
raises back to its sender and changes nothing. Values leave the lock as copies, so a reply being
serialised never observes a half-applied update.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.families.ctr.model import CTRNet, table_init
from fleetwise.plan.ps import Placement, placement
from fleetwise.runtime.ps.optim import dense_optimizer, lr_at, set_lr, sparse_optimizer
from fleetwise.runtime.ps.roles import Role, init_rpc, log, peak_rss_bytes
from fleetwise.runtime.ps.wire import ShardLayout

SparseGrads = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (global ids, gradient rows)


@dataclass
class _Step:
    """Sync staging area of one step."""

    pushes: dict[int, tuple[dict[str, torch.Tensor], SparseGrads, float]] = field(default_factory=dict)
    waiters: list[tuple[int, Future]] = field(default_factory=list)
    dense: dict[str, torch.Tensor] | None = None  # averaged over trainers
    sparse: dict[str, torch.Tensor] | None = None  # coalesced sparse COO, averaged
    held: int = 0  # bytes of gradients this step holds on the server


class ParameterServer:
    def __init__(self, cfg: RunConfig, role: Role, run_dir: Path) -> None:
        s = cfg.strategy
        assert isinstance(s, PSStrategy)
        self.cfg, self.s, self.role, self.run_dir = cfg, s, role, run_dir
        self.index, self.n_servers, self.n_trainers = role.index, s.num_servers, s.num_trainers
        self.place: Placement = placement(cfg)
        self.layout = ShardLayout.of(self.place, self.index)
        self.lock = threading.Lock()

        # Dense blocks: row ranges of the model's initial parameters (same seed as every trainer).
        model = CTRNet(cfg.model, seed=cfg.train.seed, remote_tables=True)
        named = dict(model.named_parameters())
        self.blocks = {
            b.key: nn.Parameter(named[b.name].detach()[b.row_start : b.row_stop].clone())
            for b in self.place.blocks_on(self.index)
        }
        del model, named
        # Distributed tables: rows id ≡ index (mod S), as local rows id // S.
        self.tables: dict[str, nn.Parameter] = {}
        for t in self.place.tables:
            rows = torch.arange(self.index, t.num_rows, self.n_servers)
            self.tables[t.name] = nn.Parameter(table_init(cfg.train.seed, t.field, t.num_rows, t.width, rows))
        self.table_rows = {t.name: t.num_rows for t in self.place.tables}
        self.dense_opt = dense_optimizer(self.blocks.values(), cfg.optim) if self.blocks else None
        self.sparse_opt = sparse_optimizer(self.tables.values(), s, cfg.optim) if self.tables else None

        self.applied = 0  # sync: steps applied; async: pushes applied
        self.steps: dict[int, _Step] = {}
        # steps each trainer has pushed here (inf once finished)
        self.clock: list[float] = [0] * self.n_trainers
        self.pulled_at: dict[int, int] = {}  # async: `applied` when each trainer last pulled
        self.gated: list[tuple[int, int, Future, Any]] = []  # async pulls held by max_staleness
        self.finished: set[int] = set()
        self.done = threading.Event()
        self.last_activity = time.monotonic()
        self.init_rpc_s = 0.0
        # gradient bytes held between push and apply (sync: every trainer's, then their average)
        self.transient = 0
        self.transient_peak = 0

    # ------------------------------------------------------------------ helpers

    def state_bytes(self) -> int:
        """Bytes of parameters + optimizer state tensors (scalar step counters left out), the
        quantity the planner predicts per server."""
        total = 0
        for opt in (self.dense_opt, self.sparse_opt):
            if opt is None:
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    total += p.numel() * p.element_size()
                    for v in opt.state.get(p, {}).values():
                        if torch.is_tensor(v) and v.shape == p.shape:
                            total += v.numel() * v.element_size()
        return total

    def _hold(self, nbytes: int) -> None:
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    def peak_tensor_bytes(self) -> int:
        """Peak live tensor bytes: the state plus the most gradient bytes held at once."""
        return self.state_bytes() + self.transient_peak

    def _min_clock(self) -> float:
        return min(self.clock) if self.clock else math.inf

    def _check_rows(self, name: str, ids: torch.Tensor) -> None:
        ok = (ids >= 0) & (ids < self.table_rows[name]) & (ids % self.n_servers == self.index)
        if not bool(ok.all()):
            raise ValueError(
                f"rows of table {name!r} that server {self.index} does not own: {ids[~ok][:5].tolist()}"
            )

    def _check_push(self, dense: dict[str, torch.Tensor], sparse: SparseGrads) -> None:
        for key, g in dense.items():
            if not torch.isfinite(g).all():
                raise ValueError(f"non-finite gradient for {key}")
        for name, (ids, rows) in sparse.items():
            self._check_rows(name, ids)
            if len(torch.unique(ids)) != len(ids):
                raise ValueError(f"duplicate rows of table {name!r} in one push")
            if not torch.isfinite(rows).all():
                raise ValueError(f"non-finite gradient rows for table {name!r}")

    def _sparse_coo(self, name: str, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        p = self.tables[name]
        return torch.sparse_coo_tensor(
            (ids // self.n_servers).unsqueeze(0), rows, p.shape, check_invariants=False
        ).coalesce()

    def _apply(
        self, dense: dict[str, torch.Tensor], sparse: dict[str, torch.Tensor], lr: float, scale: float
    ) -> None:
        """One optimizer step on this shard. Caller holds the lock."""
        if self.dense_opt is not None:
            for key, p in self.blocks.items():
                p.grad = dense[key] if scale == 1.0 else dense[key] * scale
            set_lr(self.dense_opt, lr)
            self.dense_opt.step()
        if self.sparse_opt is not None:
            for name, p in self.tables.items():
                g = sparse.get(name)
                p.grad = None if g is None else (g if scale == 1.0 else g * scale)
            set_lr(self.sparse_opt, lr)
            with warnings.catch_warnings():
                # Adagrad builds sparse tensors without saying whether to check them; ours are valid
                warnings.filterwarnings("ignore", "Sparse invariant checks are implicitly disabled")
                self.sparse_opt.step()
        for p in [*self.blocks.values(), *self.tables.values()]:
            p.grad = None

    def _maybe_fault(self, step: int) -> None:
        f = self.cfg.fault
        if f.kill_rank == self.role.rank and f.at_step == step + 1:
            log(self.role, f"fault hook: failing ({f.mode}) at step {step + 1}")
            if f.mode == "raise":
                raise RuntimeError(f"fault injected on server {self.index} at step {step + 1}")
            if f.mode == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ RPC handlers

    def pull(self, step: int, trainer: int, ids: torch.Tensor, counts: list[int]) -> Future:
        """Values of this server's dense blocks and of the rows `ids` (packed, see wire.py)."""
        self.last_activity = time.monotonic()
        fut: Future = Future()
        by_table = self.layout.unpack_ids((ids, counts))
        for name, i in by_table.items():
            self._check_rows(name, i)
        with self.lock:
            if self.s.mode == "sync" and step != self.applied:
                raise RuntimeError(
                    f"sync pull of step {step} but server {self.index} has applied {self.applied}"
                )
            bound = self.s.max_staleness
            if self.s.mode == "async" and bound is not None and step - self._min_clock() > bound:
                self.gated.append((step, trainer, fut, (by_table, time.perf_counter())))
                return fut
            value = self._read(trainer, by_table, 0.0)
        fut.set_result(value)
        return fut

    def _read(self, trainer: int | None, ids: dict[str, torch.Tensor], waited: float) -> dict[str, Any]:
        """A copy (torch.cat) of the dense blocks and the requested rows. Caller holds the lock."""
        if trainer is not None:
            self.pulled_at[trainer] = self.applied  # async staleness is counted from here
        dense = {k: p.detach() for k, p in self.blocks.items()}
        rows = {n: self.tables[n].detach().index_select(0, i // self.n_servers) for n, i in ids.items()}
        return {"values": self.layout.pack(dense, rows), "wait_s": waited}

    def push(
        self, step: int, trainer: int, grads: torch.Tensor, ids: torch.Tensor, counts: list[int]
    ) -> Future:
        """Gradients of this server's blocks and of the rows `ids` (packed like a pull reply)."""
        self.last_activity = time.monotonic()
        self._maybe_fault(step)
        dense, rows = self.layout.unpack(grads, counts)
        by_table = self.layout.unpack_ids((ids, counts))
        sparse = {n: (by_table[n], rows[n]) for n in by_table if len(by_table[n])}
        self._check_push(dense, sparse)
        if self.s.mode == "async":
            return self._push_async(step, trainer, dense, sparse)
        fut: Future = Future()
        ready: list[tuple[Future, Any]] = []
        with self.lock:
            if step != self.applied:
                raise RuntimeError(
                    f"sync push of step {step} but server {self.index} has applied {self.applied}"
                )
            st = self.steps.setdefault(step, _Step())
            if trainer in st.pushes:
                raise RuntimeError(f"trainer {trainer} pushed step {step} twice")
            st.pushes[trainer] = (dense, sparse, time.perf_counter())
            st.waiters.append((trainer, fut))
            self._hold(_nbytes(grads) + _nbytes(ids))
            st.held += _nbytes(grads) + _nbytes(ids)
            if len(st.pushes) == self.n_trainers:
                sqnorm = self._aggregate(st)
                now = time.perf_counter()
                for t, f in st.waiters:
                    ready.append((f, {"sqnorm": sqnorm, "wait_s": now - st.pushes[t][2]}))
                st.pushes.clear()  # the averaged gradient is kept; per-trainer copies are not
                self.transient -= st.held
                st.held = _nbytes(st.dense) + _nbytes(list(st.sparse.values()))
        for f, v in ready:
            f.set_result(v)
        return fut

    def _aggregate(self, st: _Step) -> float:
        """Average the staged gradients over trainers, summing in trainer order so the result does
        not depend on arrival order. Returns the squared norm of the average."""
        order = sorted(st.pushes)
        dense: dict[str, torch.Tensor] = {}
        for key in self.blocks:
            g = st.pushes[order[0]][0][key].clone()
            for t in order[1:]:
                g += st.pushes[t][0][key]
            dense[key] = g / self.n_trainers
        sparse: dict[str, torch.Tensor] = {}
        for name in self.tables:
            parts = [st.pushes[t][1][name] for t in order if name in st.pushes[t][1]]
            if parts:
                ids = torch.cat([i for i, _ in parts])
                rows = torch.cat([r for _, r in parts])
                sparse[name] = self._sparse_coo(name, ids, rows) / self.n_trainers  # sum, then average
        st.dense, st.sparse = dense, sparse
        self._hold(_nbytes(dense) + _nbytes(list(sparse.values())))
        sq = sum(float(g.double().pow(2).sum()) for g in dense.values())
        sq += sum(float(g.values().double().pow(2).sum()) for g in sparse.values())
        return sq

    def commit(
        self, step: int, scale: float, ids: torch.Tensor | None = None, counts: list[int] | None = None
    ) -> dict[str, Any]:
        """Apply step `step` (the first commit does; the others find it applied). With `ids`, the
        reply also carries the values of the trainer's next step (the prefetch), read after the
        update, which saves the trainer a separate pull."""
        self.last_activity = time.monotonic()
        by_table = self.layout.unpack_ids((ids, counts)) if ids is not None and counts is not None else None
        for name, i in (by_table or {}).items():
            self._check_rows(name, i)
        with self.lock:
            if self.applied == step:
                st = self.steps.get(step)
                if st is None or st.dense is None:
                    raise RuntimeError(f"commit of step {step} before every trainer staged it")
                del self.steps[step]
                self.transient -= st.held
                self._apply(st.dense, st.sparse or {}, lr_at(self.cfg, step), scale)
                self.applied += 1
            elif self.applied != step + 1:
                raise RuntimeError(
                    f"commit of step {step} but server {self.index} has applied {self.applied}"
                )
            reply: dict[str, Any] = {
                "server_bytes": self.state_bytes(),
                "peak_tensor_bytes": self.peak_tensor_bytes(),
                "peak_rss": peak_rss_bytes(),
            }
            if by_table is not None:
                reply["values"] = self._read(None, by_table, 0.0)["values"]
            return reply

    def _push_async(
        self, step: int, trainer: int, dense: dict[str, torch.Tensor], sparse: SparseGrads
    ) -> Future:
        fut: Future = Future()
        coo = {n: self._sparse_coo(n, i, r) for n, (i, r) in sparse.items()}
        held = _nbytes(dense) + _nbytes([r for _, r in sparse.values()]) + _nbytes(list(coo.values()))
        released: list[tuple[Future, Any]] = []
        with self.lock:
            self._hold(held)
            staleness = self.applied - self.pulled_at.get(trainer, self.applied)
            self._apply(dense, coo, lr_at(self.cfg, step), 1.0)
            self.applied += 1
            self.clock[trainer] = step + 1
            released = self._release_gated()
            self.transient -= held
            value = {
                "server_bytes": self.state_bytes(),
                "peak_tensor_bytes": self.peak_tensor_bytes(),
                "peak_rss": peak_rss_bytes(),
                "staleness": staleness,
                "wait_s": 0.0,
            }
        for f, v in released:
            f.set_result(v)
        fut.set_result(value)
        return fut

    def _release_gated(self) -> list[tuple[Future, Any]]:
        """Async pulls whose trainer is back within max_staleness. Caller holds the lock."""
        out, keep = [], []
        bound = self.s.max_staleness if self.s.max_staleness is not None else math.inf
        for step, trainer, fut, (ids, since) in self.gated:
            if step - self._min_clock() <= bound:
                out.append((fut, self._read(trainer, ids, time.perf_counter() - since)))
            else:
                keep.append((step, trainer, fut, (ids, since)))
        self.gated = keep
        return out

    def trainer_finished(self, trainer: int) -> None:
        with self.lock:
            self.finished.add(trainer)
            self.clock[trainer] = math.inf  # a finished trainer no longer holds the others back
            released = self._release_gated()
            if len(self.finished) == self.n_trainers:
                self.done.set()
        for f, v in released:
            f.set_result(v)

    def info(self) -> dict[str, Any]:
        import psutil

        listen = sorted(
            {
                f"{c.laddr.ip}:{c.laddr.port}"
                for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            }
        )
        with self.lock:
            return {
                "index": self.index,
                "rank": self.role.rank,
                "pid": os.getpid(),
                "listen": listen,
                "state_bytes": self.state_bytes(),
                "applied": self.applied,
                "blocks": sorted(self.blocks),
                "init_rpc_s": self.init_rpc_s,
            }

    def snapshot(self, path: Path, reason: str) -> None:
        """Write this shard (values, owned row ids, optimizer state, steps applied). Takes the
        lock, so the file never holds a half-applied update."""
        with self.lock:
            state = {
                "server": self.index,
                "num_servers": self.n_servers,
                "applied": self.applied,
                "reason": reason,
                "blocks": {k: p.detach().clone() for k, p in self.blocks.items()},
                "tables": {
                    n: {
                        "ids": torch.arange(self.index, self.table_rows[n], self.n_servers),
                        "values": p.detach().clone(),
                    }
                    for n, p in self.tables.items()
                },
                "dense_optimizer": self.dense_opt.state_dict() if self.dense_opt else None,
                "sparse_optimizer": self.sparse_opt.state_dict() if self.sparse_opt else None,
            }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # readers see the old file or the new one, never a partial one


def _nbytes(tensors: Any) -> int:
    """Bytes of the tensors in a tensor, dict or list of them."""
    if torch.is_tensor(tensors):
        if tensors.is_sparse:
            return _nbytes([tensors.indices(), tensors.values()])
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(_nbytes(v) for v in tensors.values())
    if isinstance(tensors, list | tuple):
        return sum(_nbytes(v) for v in tensors)
    return 0


# ---------------------------------------------------------------------- RPC entry points
# Module-level functions: RPC pickles a function by its qualified name.

_server: ParameterServer | None = None


def _the_server() -> ParameterServer:
    assert _server is not None, "this process is not a parameter server"
    return _server


@rpc.functions.async_execution
def pull(step: int, trainer: int, ids: torch.Tensor, counts: list[int]) -> Future:
    return _the_server().pull(step, trainer, ids, counts)


@rpc.functions.async_execution
def push(step: int, trainer: int, grads: torch.Tensor, ids: torch.Tensor, counts: list[int]) -> Future:
    return _the_server().push(step, trainer, grads, ids, counts)


def commit(step: int, scale: float, ids: torch.Tensor | None, counts: list[int] | None) -> dict[str, Any]:
    return _the_server().commit(step, scale, ids, counts)


def trainer_finished(trainer: int) -> None:
    _the_server().trainer_finished(trainer)


def info() -> dict[str, Any]:
    return _the_server().info()


def shard_path(run_dir: Path, server: int) -> Path:
    return run_dir / "ps" / f"server_{server}.pt"


def serve(cfg: RunConfig, role: Role, run_dir: Path) -> None:
    """A server process: build the shard, serve until every trainer has finished, shut down."""
    global _server
    _server = server = ParameterServer(cfg, role, run_dir)  # before init_rpc: pulls may come at once
    log(
        role,
        f"holds {len(server.blocks)} dense blocks {sorted(server.blocks)} and "
        f"{sum(p.shape[0] for p in server.tables.values())} rows of {len(server.tables)} tables; "
        f"{server.state_bytes()} bytes",
    )
    keep = cfg.checkpoint.enabled

    def on_sigterm(signum: int, _frame: Any) -> None:
        # torchrun stops the group this way when a trainer fails: keep the last consistent state.
        log(role, f"signal {signum}: stopping at {server.applied} applied steps")
        if keep:
            server.snapshot(shard_path(run_dir, role.index), reason=f"signal {signum}")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    server.init_rpc_s = init_rpc(cfg, role)
    log(role, f"init_rpc {server.init_rpc_s:.3f} s")
    # Wait in short slices (not inside rpc.shutdown) so signals are handled; stop by ourselves if
    # the trainers went silent for longer than a collective may hang (a launcher that failed to
    # stop us must not leave an orphan).
    timeout = cfg.launch.collective_timeout_s
    while not server.done.wait(0.2):
        if time.monotonic() - server.last_activity > timeout:
            log(role, f"no trainer activity for {timeout:.0f} s; exiting")
            rpc.shutdown(graceful=False)
            os._exit(1)
    if keep:
        server.snapshot(shard_path(run_dir, role.index), reason="finished")
    log(role, f"all trainers finished after {server.applied} applied updates; {server.state_bytes()} bytes")
    rpc.shutdown()
