"""Parameter server for real: `fleetwise train strategy=ps` launches of 2 trainers + 2 servers on
TensorPipe RPC (the same launcher and worker entry point as every collective job).

Four launches, assertions grouped per launch (each ~10-20 s on 2 cores):
- sync, round_robin, sliced, one non-distributed table, trainer 1 slowed: equals single-process
  training; only touched rows change; rows and blocks sit where the dispatch rule says; server
  memory equals the plan; metrics, logs, loopback sockets, no orphans.
- sync, hash_name, AdamW with clipping, sparse SGD, Wide&Deep: equals
  single-process training; the launcher's summary reads the metrics.
- async with trainer 1 slowed: the loss falls and the job outpaces the sync launch above.
- sync with trainer 1 killed mid-push: the servers keep the last complete step, nothing partial.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from conftest import compose

from fleetwise.data.ctr import SyntheticClicks, step_indices
from fleetwise.models.ctr import CTRNet
from fleetwise.plan.planner import make_plan
from fleetwise.plan.ps import placement
from fleetwise.runtime.ps.reference import load_shards, train_single_process

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


def session_processes(session: int) -> list[int]:
    """PIDs of live processes in a session (the orphan check)."""
    left = []
    for q in psutil.process_iter():
        try:
            if os.getsid(q.pid) == session:
                left.append(q.pid)
        except OSError:
            continue
    return left


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
    state, shards = load_shards(run.cfg, run.run_dir)
    assert [sh["applied"] for sh in shards] == [steps] * len(shards)
    ref, _ = train_single_process(run.cfg, steps)
    worst = 0.0
    for name, p in ref.named_parameters():
        diff = float((state[name] - p.detach()).abs().max())
        worst = max(worst, diff)
        assert diff <= atol, f"{name}: max |ps - single| = {diff:.3g} > {atol}"
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
    # 30 Adagrad steps on clicks whose planted teacher is strong enough to learn in 30 steps: the
    # embeddings move further than the other ps runs' (8 and 3 steps, 2e-6) and the servers' and
    # the reference's different summation orders add up to 2.8e-6 (about 25 float32 ulps of a
    # value near 1), measured
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
    assert not [p for p in pids if psutil.pid_exists(p)]  # every rank has exited


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
    assert_equals_single_process(run, 8, atol=2e-6)
    place = placement(run.cfg)
    _, shards = load_shards(run.cfg, run.run_dir)
    for sh in shards:
        assert sorted(sh["blocks"]) == sorted(b.key for b in place.blocks_on(sh["server"]))
    assert run.summary["server_bytes"] == make_plan(run.cfg).ps["server_bytes_per_server"]
    m = run.metrics[-1]
    assert m["memory/predicted_bytes"] == make_plan(run.cfg).memory_bytes["total"]
    assert m["memory/server_bytes_max"] <= m["memory/peak_bytes_max"] < 1.5 * m["memory/predicted_bytes"]


def test_async_trains_and_outpaces_sync_when_a_trainer_is_slow(tmp_path, sync_slowed):
    run = launch(
        tmp_path / "async",
        "train.steps=16",
        "strategy.slice_min_elements=64",
        "strategy.mode=async",
        TABLES,
        slow=SLOW,
    )
    assert run.returncode == 0, run.logs()
    losses = [m["train/loss"] for m in run.metrics]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.03, losses
    a, s = run.summary, sync_slowed.summary
    # The fast trainer is not held back: its own rate beats the sync one (where both go at the
    # slow trainer's pace), and so does the job's total rate.
    assert a["trainers"][0]["samples_per_s"] > 1.5 * s["trainers"][0]["samples_per_s"], (
        a["trainers"],
        s["trainers"],
    )
    assert a["samples_per_s"] > 1.2 * s["samples_per_s"]
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
    assert_equals_single_process(run, 3, atol=2e-6)
    assert "fault hook" in (run.run_dir / "logs" / "rank_1.log").read_text()
