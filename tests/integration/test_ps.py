"""Parameter server for real: `fleetwise train strategy=ps` launches of 2 trainers + 2 servers on
TensorPipe RPC (the same launcher and worker entry point as every collective job).

Four launches, assertions grouped per launch (each ~10-20 s on 2 cores):
- sync, round_robin, sliced, one non-distributed table, trainer 1 slowed: equals single-process
  training; only touched rows change; rows and blocks sit where the dispatch rule says; server
  memory equals the plan; metrics, logs, loopback sockets, no orphans.
- sync, hash_name, AdamW with clipping, sparse SGD, Wide&Deep: equals
  single-process training; the launcher's summary reads the metrics.
- async with trainer 1 slowed: the loss falls and trainer 0 does not wait for trainer 1 (sync: it does).
- sync with trainer 1 killed mid-push: the servers keep the last complete step, nothing partial.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers.config import compose

from fleetwise.families.ctr.data import SyntheticClicks, step_indices
from fleetwise.families.ctr.model import CTRNet
from fleetwise.plan.planner import make_plan
from fleetwise.plan.ps import placement
from fleetwise.runtime.ps.reference import load_shards

pytestmark = pytest.mark.slow

METRIC_KEYS = {
    "step",
    "train/loss",
    "train/lr",
    "perf/step_time_s",
    "perf/samples_per_s",
    "perf/samples_per_s_per_trainer",
    "ps/pull_latency_s",
    "ps/push_latency_s",
    "ps/bytes_pulled",
    "ps/bytes_pushed",
    "ps/sparse_rows_pulled",
    "memory/server_bytes_max",
    "memory/peak_bytes_max",
    "perf/mfu",
}
SLOW = "1:0.1"  # trainer 1 sleeps 100 ms per step: a straggler under any background load
TABLES = (
    "model.sparse_tables=[{name:user_id,num_embeddings:5000},{name:item_id,num_embeddings:3000},"
    "{name:category,num_embeddings:100,distributed:false},{name:city,num_embeddings:300}]"
)


class Launch:
    def __init__(self, cfg, run_dir: Path, returncode: int, output: str):
        self.cfg, self.run_dir, self.returncode, self.output = cfg, run_dir, returncode, output

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(x) for x in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "ps_summary.json").read_text())

    def logs(self) -> str:
        tails = [
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.run_dir / "logs").glob("*.log"))
        ]
        return self.output[-2000:] + "\n".join(tails)


def session_processes(session: int, wait_s: float = 30.0) -> list[int]:
    """PIDs of live processes in a session (the orphan check), after waiting up to `wait_s` for
    them to go: a loaded machine may take a moment to finish exits already under way."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for q in psutil.process_iter():
            try:
                if os.getsid(q.pid) == session and q.status() != psutil.STATUS_ZOMBIE:
                    left.append(q.pid)
            except (OSError, psutil.Error):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def launch(run_dir: Path, *overrides: str, slow: str = "") -> Launch:
    """`fleetwise train strategy=ps …` in a session of its own (every process it starts can be
    found afterwards); trainer 1 sleeps per step when `slow` says so."""
    # the batch these tolerances were measured with (one micro-batch per trainer), not the recipe's
    overrides = (
        "recipe=ctr/tiny", "train.micro_batch_size=32", "checkpoint.enabled=true", "tracking.enabled=false",
        *overrides,
    )  # fmt: skip
    cfg, problems = compose(*overrides)
    assert cfg is not None, problems
    p = subprocess.Popen(
        [str(Path(sys.executable).parent / "fleetwise"), "train", *overrides, f"run.dir={run_dir}"],
        env={**os.environ, "FLEETWISE_PS_SLOW": slow},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    left = session_processes(p.pid)
    assert not left, f"orphan processes after the run: {left}"
    return Launch(cfg, run_dir, p.returncode, out)


def assert_equals_single_process(run: Launch, steps: int, atol: float) -> float:
    """The servers' shards equal the plain PyTorch loop written in the tests (tests/helpers/ps_plain_loop.py:
    torch.optim, closed-form LR schedule, clip_grad_norm_), which shares no training code with the
    ps trainer; so do the job's logged learning rates and gradient norms."""
    from helpers.ps_plain_loop import plain_ps_loop

    state, shards = load_shards(run.cfg, run.run_dir)
    assert [sh["applied"] for sh in shards] == [steps] * len(shards)
    ref, _, norms, lrs = plain_ps_loop(run.cfg, steps)
    worst = 0.0
    for name, p in ref.named_parameters():
        diff = float((state[name] - p.detach()).abs().max())
        worst = max(worst, diff)
        assert diff <= atol, f"{name}: max |ps - single| = {diff:.3g} > {atol}"
    logged = run.metrics[:steps]  # a job that failed may not have logged its last complete steps
    assert [m["train/lr"] for m in logged] == pytest.approx(lrs[: len(logged)], rel=1e-9)
    assert [m["train/grad_norm"] for m in logged] == pytest.approx(norms[: len(logged)], rel=1e-5)
    print(f"ps vs plain loop: max |param diff| {worst:.2e}")
    return worst


@pytest.fixture(scope="module")
def sync_slowed(tmp_path_factory) -> Launch:
    run = launch(
        tmp_path_factory.mktemp("ps") / "sync",
        "train.steps=16",
        "strategy.slice_min_elements=64",
        TABLES,
        slow=SLOW,
    )
    assert run.returncode == 0, run.logs()
    return run


def test_sync_round_robin_sliced_equals_single_process_and_rows_follow_the_rules(sync_slowed):
    run, cfg = sync_slowed, sync_slowed.cfg
    steps = cfg.train.steps
    # 16 Adagrad steps on clicks whose planted teacher is strong enough to learn fast: the
    # embeddings move further than the other ps runs' and the servers' and the plain loop's
    # different summation orders add up to 1.7e-6 (measured; 2.8e-6 in a 30-step run: ~25 float32
    # ulps of a value near 1)
    assert_equals_single_process(run, steps, atol=4e-6)

    # dispatch and slicing: each server holds exactly the blocks the placement gives it
    place = placement(cfg)
    state, shards = load_shards(cfg, run.run_dir)
    for sh in shards:
        assert sorted(sh["blocks"]) == sorted(b.key for b in place.blocks_on(sh["server"]))
    sliced = {b.name for b in place.dense if b.sliced}
    assert {"mlp.0.weight", "embeddings.category.weight"} <= sliced  # something is really sliced
    # sparse rows: server s owns ids ≡ s (mod 2) of every distributed table, and nothing else
    for sh in shards:
        assert set(sh["tables"]) == {"user_id", "item_id", "city"}
        for t in place.tables:
            assert torch.equal(sh["tables"][t.name]["ids"], torch.arange(sh["server"], t.num_rows, 2))

    # only the rows some batch touched have moved
    data = SyntheticClicks(cfg.model, cfg.data)
    init = CTRNet(cfg.model, seed=cfg.train.seed)
    for t in place.tables:
        ids = np.concatenate(
            [
                data.ids(t.field, step_indices(k, cfg.train.global_batch_size, cfg.data.num_samples))
                for k in range(steps)
            ]
        )
        touched = torch.zeros(t.num_rows, dtype=torch.bool)
        touched[torch.from_numpy(np.unique(ids))] = True
        moved = (state[f"embeddings.{t.name}.weight"] != init.embeddings[t.name].weight.detach()).any(1)
        assert torch.equal(moved, touched), t.name
        assert 0 < touched.sum() < t.num_rows  # some rows stayed untouched, and kept their values

    # server memory per shard: measured tensors == plan
    summary = run.summary
    planned = make_plan(cfg).ps["server_bytes_per_server"]
    assert summary["server_bytes"] == planned
    assert all(m["memory/server_bytes_max"] == max(planned) for m in run.metrics)

    # metrics, logs, bytes, sockets, roles
    lines = run.metrics
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(set(m) >= METRIC_KEYS for m in lines)
    assert sorted(p.name for p in (run.run_dir / "logs").glob("rank_*.log")) == [
        f"rank_{r}.log" for r in range(4)
    ]
    assert "step 16/16" in (run.run_dir / "logs" / "rank_0.log").read_text()
    table_bytes = summary["sparse_table_bytes"]
    assert table_bytes == 4 * 9 * (5000 + 3000 + 300)
    assert 0 < summary["sparse_bytes_pulled_per_step_mean"] < table_bytes / 10
    for m in lines:
        assert m["ps/sparse_rows_pulled"] <= 2 * 3 * 32  # 2 trainers × 3 remote fields × 32 ids
    assert summary["role_mapping"] == {"trainers": [0, 1], "servers": [2, 3]}
    for server in summary["servers"]:
        assert server["listen"] and all(a.startswith("127.0.0.1:") for a in server["listen"])
    pids = [t["pid"] for t in summary["trainers"]] + [s["pid"] for s in summary["servers"]]
    assert not [
        p for p in pids if psutil.pid_exists(p)
    ]  # every rank has exited (checked after the wait above)


def test_fleetwise_train_sync_hash_name_adamw_clipped_equals_single_process(tmp_path, fleetwise_bin):
    # through the real command: `fleetwise train` launches the ranks and calls runtime.ps.run
    overrides = [
        "recipe=ctr/tiny",
        "train.micro_batch_size=32",
        "train.steps=8",
        "strategy.dispatch=hash_name",
        "strategy.slice_min_elements=64",
        "strategy.sparse_optimizer=sgd",
        "optim=adamw",
        "optim.grad_clip=0.1",
        "model.kind=wide_deep",
        "checkpoint.enabled=true",
        "tracking.enabled=false",
    ]
    run_dir = tmp_path / "hash"
    p = subprocess.Popen(
        [fleetwise_bin, "train", *overrides, f"run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, _ = p.communicate(timeout=180)
    assert not session_processes(p.pid), "orphan processes after the run"
    cfg, _ = compose(*overrides)
    run = Launch(cfg, run_dir, p.returncode, out)
    assert run.returncode == 0, run.logs()
    assert "final loss" in out  # the launcher's summary read our metrics
    assert max(m["train/grad_norm"] for m in run.metrics) > 0.1  # clipping acted
    assert run.metrics[0]["train/lr"] < run.metrics[1]["train/lr"]  # warm-up, then cosine
    assert_equals_single_process(run, 8, atol=5e-7)  # measured 1.5e-8
    place = placement(run.cfg)
    _, shards = load_shards(run.cfg, run.run_dir)
    for sh in shards:
        assert sorted(sh["blocks"]) == sorted(b.key for b in place.blocks_on(sh["server"]))
    assert run.summary["server_bytes"] == make_plan(run.cfg).ps["server_bytes_per_server"]
    m = run.metrics[-1]
    assert m["memory/predicted_bytes"] == make_plan(run.cfg).memory_bytes["total"]
    # the fullest process's live tensor bytes vs the plan's worst device: measured 1.13 (the bound
    # was 1.5 with no stated reason)
    print("ps peak / predicted", m["memory/peak_bytes_max"] / m["memory/predicted_bytes"])
    assert m["memory/server_bytes_max"] <= m["memory/peak_bytes_max"] < 1.25 * m["memory/predicted_bytes"]


def test_async_trains_and_the_fast_trainer_does_not_wait_for_the_slow_one(tmp_path, sync_slowed):
    """Progress independence, measured side by side inside each run (so background load, which
    slows both trainers alike, does not decide it): in sync mode trainer 0 waits for trainer 1's
    push every step, so its loop takes at least trainer 1's sleeps; in async mode it does not, so
    it finishes well before the slowed trainer 1. (Before: async had to beat sync's throughput by
    1.2-1.5x across two launches, which load on the machine could decide.)"""
    sleep_s = 0.25  # trainer 1's per-step sleep in the async run
    run = launch(
        tmp_path / "async",
        "train.steps=16",
        "strategy.slice_min_elements=64",
        "strategy.mode=async",
        TABLES,
        slow=f"1:{sleep_s}",
    )
    assert run.returncode == 0, run.logs()
    losses = [m["train/loss"] for m in run.metrics]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.03, losses
    steps = run.cfg.train.steps
    # sync: trainer 0 is held back by trainer 1's sleeps (a lower bound: load only adds to it)
    s0, s1 = (t["train_time_s"] for t in sync_slowed.summary["trainers"])
    slow_sync = float(SLOW.split(":")[1]) * steps
    assert s0 > 0.8 * slow_sync, (s0, s1, slow_sync)
    # async: trainer 0 does the same work without the sleeps and no waiting; it ends at least half
    # of trainer 1's total sleep earlier than trainer 1 (with waiting it would end with it)
    a0, a1 = (t["train_time_s"] for t in run.summary["trainers"])
    print(
        f"sync trainer times {s0:.2f} {s1:.2f} s; async {a0:.2f} {a1:.2f} s; async sleeps {sleep_s * steps:.1f} s"
    )
    assert a1 - a0 > 0.5 * sleep_s * steps, (a0, a1)
    assert max(m["ps/staleness"] for m in run.metrics) > 0  # updates really interleaved


def test_a_trainer_killed_mid_push_leaves_the_last_complete_step(tmp_path):
    run = launch(
        tmp_path / "kill",
        "train.steps=10",
        "fault.kill_rank=1",
        "fault.at_step=4",
        "fault.mode=sigkill",
    )
    assert run.returncode != 0
    _, shards = load_shards(run.cfg, run.run_dir)
    # Trainer 1's step-4 gradients reached server 0 only: neither server applied step 4.
    assert [sh["applied"] for sh in shards] == [3, 3]
    assert all(sh["reason"].startswith("signal") for sh in shards)
    assert_equals_single_process(run, 3, atol=2e-6)  # measured 8e-7 (Adagrad)
    assert "fault hook" in (run.run_dir / "logs" / "rank_1.log").read_text()
