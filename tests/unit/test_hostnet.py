"""A node of a multi-node job derives its address, interface and rendezvous role from the route to
launch.rdzv_endpoint (fleetwise/hostnet.py); the torchrun command and the ranks' environment carry
them. Real hosts: tests/integration/test_multihost.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.config import compose

from fleetwise import hostnet
from fleetwise.launcher import torchrun

# Two interfaces: a management network and the cluster network node 0 is on.
ADDRS = {"127.0.0.1": "lo", "192.168.1.7": "eth0", "10.77.0.2": "ib0"}


def _route(ip: str) -> str:
    return {"10.77.0.1": "10.77.0.2", "10.77.0.2": "10.77.0.2", "127.0.0.1": "127.0.0.1"}[ip]


def test_the_route_to_the_endpoint_picks_address_interface_and_role():
    joiner = hostnet.node_network("10.77.0.1:29555", ADDRS, _route)
    assert joiner == hostnet.NodeNet("10.77.0.1", "10.77.0.2", "ib0", is_host=False)
    host = hostnet.node_network("10.77.0.2:29555", ADDRS, _route)
    assert (host.is_host, host.local_addr, host.iface) == (True, "10.77.0.2", "ib0")
    # torchrun: one --rdzv-conf holding is_host beside the other settings (a second flag would
    # replace the first), and the address the other nodes reach this one at
    assert hostnet.torchrun_args(joiner, ["last_call_timeout=30"]) == [
        "--rdzv-conf=last_call_timeout=30,is_host=false",
        "--local-addr=10.77.0.2",
    ]
    assert hostnet.torchrun_args(host, [])[0] == "--rdzv-conf=is_host=true"
    # every library on ib0 (not the management eth0), except where the user chose
    env = hostnet.interface_env(joiner, {"NCCL_SOCKET_IFNAME": "ib1"})
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "TP_SOCKET_IFNAME": "ib0"}
    line = hostnet.describe(joiner, env)
    assert "joins" in line and "10.77.0.2 on ib0" in line and "GLOO_SOCKET_IFNAME=ib0" in line


def test_a_loopback_endpoint_keeps_torchs_own_choice():
    net = hostnet.node_network("127.0.0.1:29555", ADDRS, _route)
    assert net.loopback and net.is_host
    assert hostnet.torchrun_args(net, ["last_call_timeout=30"]) == ["--rdzv-conf=last_call_timeout=30"]
    assert hostnet.interface_env(net, {}) == {}


def test_the_real_route_of_this_machine():
    """No injection: localhost resolves, and the source address of a route is one of ours."""
    assert hostnet.resolve("localhost") in ("127.0.0.1", "::1")
    net = hostnet.node_network("localhost:29500")
    assert net.loopback and net.local_addr in hostnet.local_addresses()
    with pytest.raises(hostnet.NetworkError, match="cannot resolve"):
        hostnet.resolve("no-such-host.invalid")


def test_multi_node_torchrun_command_carries_the_derived_network():
    cfg, problems = compose(
        "recipe=gpt/tiny",
        "hardware.nodes=2",
        "hardware.devices_per_node=1",
        "launch.node_rank=1",
        "launch.rdzv_endpoint=10.77.0.1:29555",
    )
    assert not problems
    net = hostnet.node_network(cfg.launch.rdzv_endpoint, ADDRS, _route)
    cmd = torchrun.torchrun_command(cfg, Path("/tmp/run"), net)
    assert [c for c in cmd if c.startswith("--rdzv-conf")] == [
        f"--rdzv-conf=last_call_timeout={cfg.launch.rdzv_last_call_s},is_host=false"
    ]
    assert "--local-addr=10.77.0.2" in cmd and "--rdzv-endpoint=10.77.0.1:29555" in cmd
    assert cmd[3] == "--bind=10.77.0.2"  # what this node's agent hosts listens there only
    # a joining node's agent waits for node 0's store itself; node 0 hosts it and does not
    assert cmd[4] == "--wait-for=10.77.0.1:29555"
    node0 = hostnet.node_network("10.77.0.2:29555", ADDRS, _route)
    assert not any(
        c.startswith("--wait-for") for c in torchrun.torchrun_command(cfg, Path("/tmp/run"), node0)
    )


def test_a_joining_node_connects_within_half_a_second_of_the_store_coming_up():
    """hostnet.wait_for_store against a plain socket that starts listening 2 s later (as node 0's
    store does when node 0 starts after this node): it returns within its 0.5 s poll of the listen,
    where torch's own client, backing off, would try again seconds later; with nothing listening it
    gives up at its timeout and says so."""
    import socket
    import threading
    import time

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    up: list[float] = []
    server = socket.socket()

    def listen_later():
        time.sleep(2.0)
        server.bind(("127.0.0.1", port))
        server.listen()
        up.append(time.monotonic())

    said: list[str] = []
    threading.Thread(target=listen_later, daemon=True).start()
    try:
        assert hostnet.wait_for_store("127.0.0.1", port, timeout=30, say=said.append)
        late = time.monotonic() - up[0]
    finally:
        server.close()
    assert late < 1.0, late  # the poll's 0.5 s, and a busy machine's scheduling
    assert "waiting for the rendezvous store at 127.0.0.1" in said[0] and "answered after" in said[1]
    said.clear()
    assert not hostnet.wait_for_store("127.0.0.1", port, timeout=1.0, interval=0.2, say=said.append)
    assert "did not answer in 1 s" in said[-1]


def test_an_endpoint_this_node_cannot_resolve_is_refused_before_launch():
    from fleetwise.launcher.sweeps import check_points

    point = ["recipe=gpt/tiny", "hardware.nodes=2", "hardware.devices_per_node=1"]
    point.append("launch.rdzv_endpoint=no-such-host.invalid:29500")
    problems, checked = check_points([point])
    assert checked == {}
    assert [p.loc for p in problems] == ["launch.rdzv_endpoint"]
    assert "cannot resolve 'no-such-host.invalid'" in problems[0].msg


@pytest.mark.parametrize(
    "endpoint,allow,refused",
    [("10.77.0.1:29555", False, True), ("10.77.0.1:29555", True, False), ("127.0.0.1:29555", False, False)],
)
def test_ps_across_machines_needs_remote_servers_allowed(endpoint, allow, refused):
    _, problems = compose(
        "recipe=ctr/tiny",
        "hardware.nodes=2",
        f"launch.rdzv_endpoint={endpoint}",
        f"strategy.allow_remote_servers={str(allow).lower()}",
    )
    assert [p.loc for p in problems] == (["strategy.allow_remote_servers"] if refused else [])


def test_inter_node_latency_prices_only_the_collectives_that_cross_nodes():
    """hardware.inter_node_latency_us replaces comm_latency_us for the mesh dims whose groups span
    nodes: linear in it for dp across 2 nodes, no effect on the same layout inside one node."""
    from fleetwise.plan import make_plan

    def comm(*overrides: str) -> dict[str, float]:
        cfg, problems = compose("recipe=gpt/tiny", "hardware.comm_latency_us=20", *overrides)
        assert not problems
        return make_plan(cfg).time_s

    across = ("hardware.nodes=2", "hardware.devices_per_node=1", "launch.rdzv_endpoint=10.77.0.1:29555")
    t0, t1, t2 = (comm(*across, f"hardware.inter_node_latency_us={us}") for us in (0, 1000, 2000))
    assert t1["comm_dp"] - t0["comm_dp"] == pytest.approx(t2["comm_dp"] - t1["comm_dp"], rel=1e-9)
    assert t1["comm_dp"] - t0["comm_dp"] > 0.5e-3  # at least one all-reduce call per step
    assert comm(*across)["comm_dp"] == pytest.approx(
        comm(*across, "hardware.inter_node_latency_us=20")["comm_dp"]
    )
    inside = ("hardware.devices_per_node=2",)
    assert comm(*inside)["comm_dp"] == comm(*inside, "hardware.inter_node_latency_us=5000")["comm_dp"]


def test_calibrate_link_options_are_checked_and_only_the_link_keys_change(tmp_path):
    """`fleetwise calibrate --nodes N`: a missing endpoint, a rank out of range and --link-only
    without a profile are each listed, exit 2, before anything is measured; update_link rewrites the
    two inter-node keys of a profile (adding one it lacks) and keeps every other line."""
    r = run_cli(
        "calibrate", "--nodes", "2", "--node-rank", "2", "--link-only", "--out", str(tmp_path / "no.yaml")
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--endpoint HOST:PORT" in r.stderr and "--node-rank 2: must be 0..1" in r.stderr
    assert f"{tmp_path / 'no.yaml'} does not exist" in r.stderr
    from fleetwise.calibrate.profile import update_link

    profile = tmp_path / "p.yaml"
    profile.write_text("# mine\nname: x\ninter_node_gbps: 1.25  # 10 GbE\ncomm_latency_us: 210\n")
    text = update_link(profile, {"inter_node_gbps": 0.123456, "inter_node_latency_us": 1454.44})
    assert text.splitlines()[:2] == ["# mine", "name: x"] and "comm_latency_us: 210" in text
    import yaml

    loaded = yaml.safe_load(text)
    # 4 significant figures (calibrate/profile.py `significant`)
    assert (loaded["inter_node_gbps"], loaded["inter_node_latency_us"]) == (0.1235, 1454.0)
