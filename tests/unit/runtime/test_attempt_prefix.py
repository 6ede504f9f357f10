"""The rendezvous store prefix of a restarted multi-node group (runtime/mesh.py `attempt_prefix`):
the same on every node. When a rank of node A dies, A's agent restarts its workers and counts a
restart; node B's agent restarts through `num_nodes_waiting` and does not count. Under NCCL the
two nodes' ranks then waited for each other under different prefixes until the collective timeout
(gloo fails fast, so no CPU job showed it)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from fleetwise.runtime.mesh import attempt_prefix, attempt_store

ROUND = 3  # the rendezvous round both agents read once the group formed again


def test_both_agents_views_of_the_first_restart_give_one_prefix():
    node_a = attempt_prefix(restart=1, group_round=ROUND)  # its rank died: it counted a restart
    node_b = attempt_prefix(restart=0, group_round=ROUND)  # restarted for the waiting node: no count
    assert node_a == node_b
    # a group formed again is a new round, and a new prefix: no stale keys of the last attempt
    assert attempt_prefix(restart=1, group_round=ROUND + 1) != node_a
    assert attempt_prefix(restart=0, group_round=ROUND + 1) != node_b
    # no round exported (a plain torchrun, one node): the restart count still separates attempts
    assert attempt_prefix(0, None) != attempt_prefix(1, None)


@pytest.fixture
def agent_store(monkeypatch):
    """The store torchrun's agent hosts, which the ranks of both nodes join as clients."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    yield server


def test_a_key_rank_0_publishes_on_node_a_reaches_rank_1_on_node_b(agent_store):
    """What gloo and NCCL do at start-up: rank 0 publishes (its address, NCCL's unique id) and the
    others wait for it, each through the prefix its node's view gives."""
    timeout = timedelta(seconds=2)
    rank0 = attempt_store(0, 2, attempt_prefix(restart=1, group_round=ROUND), timeout)
    rank1 = attempt_store(1, 2, attempt_prefix(restart=0, group_round=ROUND), timeout)
    rank0.set("nccl_unique_id", b"rank 0 of the restarted group")
    rank1.wait(["nccl_unique_id"], timeout)  # raises after 2 s under another prefix
    assert rank1.get("nccl_unique_id") == b"rank 0 of the restarted group"
