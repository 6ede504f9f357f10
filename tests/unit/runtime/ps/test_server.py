"""Parameter-server logic in one process (no RPC): staging, barrier, atomic commit, validation,
staleness bound, and trainer + servers == single-process training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.config import compose

from fleetwise.runtime.ps.roles import Role, role_of
from fleetwise.runtime.ps.server import ParameterServer
from fleetwise.runtime.ps.trainer import Trainer


def ps_cfg(*overrides: str):
    cfg, problems = compose("recipe=ctr/tiny", *overrides)
    assert cfg is not None, problems
    return cfg


def servers_of(cfg) -> list[ParameterServer]:
    s = cfg.strategy
    world = s.num_servers + s.num_trainers
    return [
        ParameterServer(cfg, Role("server", i, s.num_trainers + i, world), Path("/nonexistent"))
        for i in range(s.num_servers)
    ]


class Done:
    """A completed future for direct calls."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value.wait() if hasattr(self.value, "wait") else self.value


def direct(servers):
    return lambda s, method, args: Done(getattr(servers[s], method)(*args))


def state_of(servers, cfg) -> dict[str, torch.Tensor]:
    """Full model state from live servers (the same layout as the shard files)."""
    from fleetwise.plan.ps import placement, table_parameter_names

    place = placement(cfg)
    blocks = {k: p.detach() for srv in servers for k, p in srv.blocks.items()}
    out = {}
    for name in place.dense_names:
        parts = sorted((b for b in place.dense if b.name == name), key=lambda b: b.index)
        out[name] = torch.cat([blocks[b.key] for b in parts])
    for t in place.tables:
        full = torch.empty(t.num_rows, t.width)
        for i, srv in enumerate(servers):
            full[i :: len(servers)] = srv.tables[t.name].detach()
        e, f = table_parameter_names(t.name)
        out[e], out[f] = full[:, :-1], full[:, -1:]
    return out


def test_role_mapping_puts_trainers_first():
    s = ps_cfg("strategy.num_servers=3").strategy
    roles = [role_of(s, r, 5) for r in range(5)]
    assert [(r.kind, r.index) for r in roles] == [
        ("trainer", 0),
        ("trainer", 1),
        ("server", 0),
        ("server", 1),
        ("server", 2),
    ]
    assert roles[0].name == "trainer0" and roles[4].name == "server2"
    with pytest.raises(RuntimeError, match=r"num_trainers\(2\) \+ num_servers\(3\) = 5"):
        role_of(s, 0, 4)


# warm-up, then cosine decay over the 6 steps the test runs: a constant or wrong LR shows
SCHEDULE = ("train.steps=6", "optim.warmup_steps=2", "optim.schedule=cosine", "optim.min_lr_ratio=0.1")


@pytest.mark.parametrize(
    "overrides",
    [
        ("strategy.slice_min_elements=64",),
        ("strategy.dispatch=hash_name", "strategy.slice_min_elements=64", "strategy.num_servers=3"),
        (
            "optim=adamw",
            "optim.grad_clip=0.05",  # small enough that clipping acts
            "strategy.sparse_optimizer=sgd",
            "model.kind=wide_deep",
            "model.sparse_tables=[{name:u,num_embeddings:300},{name:c,num_embeddings:40,distributed:false}]",
        ),
    ],
)
def test_one_trainer_with_sharded_servers_equals_single_process(overrides):
    """Equals a plain PyTorch loop written in the tests (tests/helpers/ps_plain_loop.py: torch.optim, the
    LR schedule in closed form, clip_grad_norm_), not the product's own reference, which shares the
    trainer's optimizer and schedule code. Measured differences (float32 summation order):
    parameters <= 1.5e-7, losses <= 7.5e-8, gradient norms <= 1.6e-7 relative; bounds ~7-12x that."""
    from helpers.ps_plain_loop import plain_ps_loop

    cfg = ps_cfg(
        "strategy.num_trainers=1", "train.micro_batch_size=16", *SCHEDULE, *overrides
    )  # 4 micro-batches
    servers = servers_of(cfg)
    trainer = Trainer(cfg, Role("trainer", 0, 0, 1 + len(servers)), call=direct(servers))
    steps = cfg.train.steps
    recs = [trainer.step(k) for k in range(steps)]
    ref, losses, norms, lrs = plain_ps_loop(cfg, steps)
    got = state_of(servers, cfg)
    worst = max(float((got[name] - p.detach()).abs().max()) for name, p in ref.named_parameters())
    dl = max(abs(r["loss"] - x) for r, x in zip(recs, losses, strict=True))
    dn = max(abs(r["grad_norm"] / x - 1) for r, x in zip(recs, norms, strict=True))
    print(f"max |param diff| {worst:.2e}, |loss diff| {dl:.2e}, grad norm rel {dn:.2e}")
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-6, rtol=0, msg=name)
    assert [r["loss"] for r in recs] == pytest.approx(losses, abs=5e-7, rel=0)
    assert [r["grad_norm"] for r in recs] == pytest.approx(norms, rel=2e-6)
    assert lrs[0] == cfg.optim.lr / 2 and lrs[2] == cfg.optim.lr and lrs[-1] < 0.3 * cfg.optim.lr  # it acts
    moved = max(float((got[n] - p).abs().max()) for n, p in initial_model(cfg).named_parameters())
    assert moved > 100 * 1e-6, moved  # training moved parameters far beyond the tolerance
    if cfg.optim.grad_clip and cfg.optim.grad_clip < 0.1:
        assert min(norms) > cfg.optim.grad_clip  # clipping acted in every step
    width = cfg.model.embedding_dim + 1
    remote_fields = sum(t.distributed for t in cfg.model.sparse_tables)
    for r in recs:  # the prefetch pulls each distinct row of the step once, nothing else
        assert 0 < r["sparse_rows_pulled"] <= remote_fields * 64
        assert r["sparse_bytes_pulled"] == r["sparse_rows_pulled"] * 4 * width


def initial_model(cfg):
    from fleetwise.families.ctr.model import CTRNet

    return CTRNet(cfg.model, seed=cfg.train.seed)


def push(srv: ParameterServer, step: int, trainer: int, dense, sparse):
    """Send gradients given as dicts in the wire format (one values tensor, one ids tensor)."""
    grads = srv.layout.pack(dense, {n: r for n, (_, r) in sparse.items()})
    return srv.push(step, trainer, grads, *srv.layout.pack_ids({n: i for n, (i, _) in sparse.items()}))


def pull(srv: ParameterServer, step: int, trainer: int, ids):
    return srv.pull(step, trainer, *srv.layout.pack_ids(ids))


def _grads(srv: ParameterServer, value: float, trainer_ids: torch.Tensor | None = None):
    dense = {k: torch.full_like(p, value) for k, p in srv.blocks.items()}
    ids = torch.tensor([srv.index, srv.index + 2]) if trainer_ids is None else trainer_ids
    sparse = {"user_id": (ids, torch.full((len(ids), 9), value))}
    return dense, sparse


def test_sync_step_is_applied_only_when_every_trainer_staged_and_committed():
    cfg = ps_cfg(
        "optim=sgd",
        "optim.weight_decay=0",
        "optim.momentum=0",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "strategy.sparse_optimizer=sgd",
    )
    srv = servers_of(cfg)[0]
    before = {k: p.detach().clone() for k, p in srv.blocks.items()}
    row0 = srv.tables["user_id"].detach()[0].clone()
    f0 = push(srv, 0, 0, *_grads(srv, 1.0))
    assert not f0.done()  # the barrier: trainer 1 has not pushed
    with pytest.raises(RuntimeError, match="before every trainer staged"):
        srv.commit(0, 1.0)
    f1 = push(srv, 0, 1, *_grads(srv, 3.0))
    assert f0.done() and f1.done()
    n_dense = sum(p.numel() for p in srv.blocks.values())
    # squared norm of the average (2.0 everywhere): dense elements + 2 rows of 9
    assert f0.value()["sqnorm"] == pytest.approx(4.0 * (n_dense + 18))
    assert all(torch.equal(p, before[k]) for k, p in srv.blocks.items())  # staged, not applied
    srv.commit(0, 0.5)  # the first commit applies, with the clipping factor
    srv.commit(0, 0.5)  # the second finds it applied
    lr = cfg.optim.lr
    for k, p in srv.blocks.items():
        torch.testing.assert_close(p.detach(), before[k] - lr * 0.5 * 2.0)
    torch.testing.assert_close(srv.tables["user_id"].detach()[0], row0 - lr * 0.5 * 2.0)
    assert srv.applied == 1
    with pytest.raises(RuntimeError, match="has applied 1"):
        push(srv, 0, 0, *_grads(srv, 1.0))


def test_a_malformed_or_partial_push_changes_nothing():
    cfg = ps_cfg()
    srv = servers_of(cfg)[1]
    snapshot = {k: p.detach().clone() for k, p in [*srv.blocks.items(), *srv.tables.items()]}
    dense, sparse = _grads(srv, 1.0)  # rows 1 and 3 of user_id
    grads = srv.layout.pack(dense, {n: r for n, (_, r) in sparse.items()})
    ids, counts = srv.layout.pack_ids({n: i for n, (i, _) in sparse.items()})
    bad = [
        (grads[:-1], ids, counts),  # truncated: a partial message
        (grads, torch.tensor([0, 2]), counts),  # rows of server 0
        (grads, torch.tensor([1, 5001]), counts),  # out of range
        (grads, torch.tensor([1, 1]), counts),  # the same row twice
        (grads, ids, [1, 0, 0, 0]),  # counts do not match the ids
        (grads * float("nan"), ids, counts),  # non-finite
    ]
    for g, i, c in bad:
        with pytest.raises(ValueError):
            srv.push(0, 0, g, i, c)
    assert not srv.steps  # nothing staged
    srv.push(0, 0, grads, ids, counts)  # the well-formed push is accepted
    assert list(srv.steps[0].pushes) == [0]
    for k, p in [*srv.blocks.items(), *srv.tables.items()]:
        assert torch.equal(p.detach(), snapshot[k])


def test_async_applies_on_arrival_and_bounds_staleness():
    cfg = ps_cfg("strategy.mode=async", "strategy.max_staleness=1")
    srv = servers_of(cfg)[0]
    ids = {"user_id": torch.tensor([0, 2])}
    before = srv.blocks["mlp.0.weight"].detach().clone()
    assert pull(srv, 0, 0, ids).done()
    push(srv, 0, 0, *_grads(srv, 1.0))
    assert srv.applied == 1 and not torch.equal(srv.blocks["mlp.0.weight"].detach(), before)
    push(srv, 1, 0, *_grads(srv, 1.0))
    held = pull(srv, 2, 0, ids)  # trainer 0 would be 2 steps ahead of trainer 1 (at 0)
    assert not held.done()
    push(srv, 0, 1, *_grads(srv, 1.0))  # trainer 1 catches up to 1 step behind: released
    assert held.done() and held.value()["wait_s"] >= 0
    held = pull(srv, 3, 0, ids)
    assert not held.done()
    srv.trainer_finished(1)  # a finished trainer holds nobody back
    assert held.done()
    # staleness: updates applied by others between a trainer's pull and its push
    assert pull(srv, 2, 1, ids).done()
    push(srv, 2, 0, *_grads(srv, 1.0))
    assert push(srv, 2, 1, *_grads(srv, 1.0)).value()["staleness"] == 1


def test_server_memory_is_parameters_plus_optimizer_state_as_planned():
    from fleetwise.plan.planner import make_plan

    for overrides in [(), ("optim=adamw", "strategy.dispatch=hash_name", "strategy.slice_min_elements=64")]:
        cfg = ps_cfg(*overrides)
        servers = servers_of(cfg)
        trainer = Trainer(cfg, Role("trainer", 0, 0, 4), call=direct(servers))
        del trainer  # building a trainer must not touch the servers
        planned = make_plan(cfg).ps["server_bytes_per_server"]
        if cfg.optim.name == "adamw":
            # AdamW allocates its moments at the first step
            for srv in servers:
                push(srv, 0, 0, *_grads_for(srv))
                push(srv, 0, 1, *_grads_for(srv))
                srv.commit(0, 1.0)
        assert [srv.state_bytes() for srv in servers] == planned


def _grads_for(srv: ParameterServer):
    dense = {k: torch.zeros_like(p) for k, p in srv.blocks.items()}
    return dense, {}
