"""The torchrun side of a job (launcher/torchrun.py, launcher/agent.py): a torn metrics line is
skipped, the rendezvous id is random per single-node job and shared by the nodes of a multi-node
job, single-node stores listen on loopback only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.config import compose

from fleetwise.launcher import torchrun


def _cfg(*overrides):
    cfg, problems = compose("recipe=gpt/tiny", *overrides)
    assert cfg is not None, problems
    return cfg


def test_a_torn_metrics_line_is_skipped_not_fatal():
    assert torchrun.metrics_record('{"step": 3, "train/loss": 1.5}') == {"step": 3, "train/loss": 1.5}
    for torn in ('{"step": 4, "train/lo', "", "[1, 2]", '{"step": "x"}', "\x00\x00"):
        assert torchrun.metrics_record(torn) is None


def test_rdzv_id_is_random_per_single_node_job_and_shared_by_the_nodes_of_one_job():
    one = _cfg("launch.rdzv_endpoint=127.0.0.1:29999")
    assert torchrun.rdzv_id(one) != torchrun.rdzv_id(one) and len(torchrun.rdzv_id(one)) >= 24
    node = ("hardware.nodes=2", "hardware.devices_per_node=2", "launch.rdzv_endpoint=10.0.0.1:29500")
    ids = {torchrun.rdzv_id(_cfg(*node, f"launch.node_rank={r}")) for r in (0, 1)}
    assert len(ids) == 1
    assert torchrun.rdzv_id(_cfg(*node, "train.steps=9")) not in ids  # another job, another id
    assert torchrun.rdzv_id(_cfg(*node, "launch.rdzv_id=job-42")) == "job-42"
    cmd = torchrun.torchrun_command(one, Path("/tmp/run"))
    assert any(c.startswith("--rdzv-id=fw-") for c in cmd)


def _listen_address(port: int) -> str:
    """The local address a TCP port listens on, from /proc/net/tcp (hex, little-endian IPv4)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # LISTEN
            return ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return ""


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="Linux /proc/net/tcp")
def test_single_node_stores_listen_on_loopback_only():
    """torch's TCPStore server binds every interface; the agent's listens on 127.0.0.1."""
    import datetime

    import torch.distributed as dist

    from fleetwise.launcher.agent import bound_store_class

    store = bound_store_class(dist.TCPStore, "127.0.0.1")("localhost", 0, is_master=True, multi_tenant=True)
    assert isinstance(store, dist.TCPStore) and _listen_address(store.port) == "127.0.0.1"
    client = dist.TCPStore("127.0.0.1", store.port, timeout=datetime.timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
    # a second host of the same port (two nodes of one job on one machine both try to host) gets
    # the RuntimeError torch's rendezvous takes as "join as a client", not an OSError it lets through
    with pytest.raises(dist.DistNetworkError, match="in use"):
        bound_store_class(dist.TCPStore, "127.0.0.1")("localhost", store.port, is_master=True)
    cmd = torchrun.torchrun_command(_cfg(), Path("/tmp/run"))
    assert cmd[2:4] == ["fleetwise.launcher.agent", "--bind=127.0.0.1"] and "--local-addr=127.0.0.1" in cmd
    assert any(c.startswith("--rdzv-endpoint=127.0.0.1:") for c in cmd)


def test_the_fork_server_preloads_modules_that_exist():
    """The fork server skips a preload module that fails to import, silently (multiprocessing's
    forkserver): a renamed module would cost every rank its imports again, unseen."""
    import importlib.util

    from fleetwise.launcher.agent import PRELOAD, WORKER

    assert WORKER in PRELOAD
    assert [m for m in PRELOAD if importlib.util.find_spec(m) is None] == []


def test_ranks_get_their_core_share_and_passive_openmp_threads_unless_the_user_set_them(monkeypatch):
    from fleetwise.launcher.torchrun import rank_thread_env

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert rank_thread_env({}, 2) == {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}
    assert rank_thread_env({}, 16) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert rank_thread_env({"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}, 2) == {}
    assert rank_thread_env({"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": ""}, 2) == {"OMP_WAIT_POLICY": "PASSIVE"}
