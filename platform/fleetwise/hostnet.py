"""Which address and interface a node of a multi-node job uses, derived from the rendezvous route.

Used by the launcher (the torchrun command, the ranks' interface variables, the preflight refusal)
and by `fleetwise calibrate`'s inter-node probe, which joins its peers the way a job does: so it
sits below both (standard library only; `network_problems` reports a config Problem).

A user sets `launch.rdzv_endpoint=HOST:PORT` (HOST: node 0's address on the cluster network) and
the same on every node. torch alone gets three things wrong on real hosts (measured across network
namespaces, see DESIGN.md):

* who hosts the rendezvous store: torch matches HOST against the machine's *hostname*, which misses
  an address on a multi-homed host (and matches on every machine sharing a hostname);
* MASTER_ADDR: torch publishes the hosting node's hostname, which may resolve to loopback
  (127.0.1.1 in Debian's /etc/hosts) or to another network;
* the interface gloo/NCCL/TensorPipe listen on: their own guess from the hostname.

So each node derives from the kernel's route to HOST: `local_addr`, the source address of that
route (this node's address on the network that reaches node 0, passed as `--local-addr`: the
address the other nodes connect to); `iface`, the interface holding it (GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME unless the user set them); `is_host`, whether HOST is one of
this machine's own addresses (`--rdzv-conf=is_host=true|false`: exactly the node at HOST hosts
the store). A loopback endpoint (every node on one machine) keeps torch's own behaviour.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

# Environment variables naming the interface each communication library listens and connects on.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


class NetworkError(RuntimeError):
    """The rendezvous endpoint cannot be resolved or reached from this node."""


@dataclass(frozen=True)
class NodeNet:
    endpoint_ip: str  # the rendezvous host, resolved
    local_addr: str  # this node's address on the route to it
    iface: str | None  # the interface holding local_addr
    is_host: bool  # the endpoint is this machine: it hosts the rendezvous store

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.endpoint_ip).is_loopback


def resolve(host: str) -> str:
    """The IP address of `host` (an address is returned as it is), IPv4 preferred."""
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as err:
        raise NetworkError(f"cannot resolve {host!r}: {err}") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return infos[0][4][0]


def route_source(ip: str) -> str:
    """This machine's source address for packets to `ip` (the kernel's route; nothing is sent)."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError as err:
            raise NetworkError(f"no route from this node to {ip}: {err}") from None
        return s.getsockname()[0]


def local_addresses() -> dict[str, str]:
    """Every address of this machine's interfaces -> the interface's name."""
    import psutil

    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.setdefault(a.address.split("%")[0], name)
    return out


def node_network(endpoint: str, addresses: dict[str, str] | None = None, source=route_source) -> NodeNet:
    """The NodeNet of this machine for the rendezvous endpoint HOST:PORT."""
    host, _, _ = endpoint.rpartition(":")
    ip = resolve(host)
    addresses = local_addresses() if addresses is None else addresses
    local = source(ip)
    return NodeNet(endpoint_ip=ip, local_addr=local, iface=addresses.get(local), is_host=ip in addresses)


def torchrun_args(net: NodeNet, rdzv_conf: list[str]) -> list[str]:
    """torchrun's --rdzv-conf (`rdzv_conf` plus is_host) and --local-addr for this node: its
    rendezvous role and the address the other nodes reach it at. A loopback endpoint (every node
    on this machine) leaves both to torch, whose hostname match lets the first node host."""
    if net.loopback:
        return [f"--rdzv-conf={','.join(rdzv_conf)}"]
    conf = [*rdzv_conf, f"is_host={str(net.is_host).lower()}"]
    return [f"--rdzv-conf={','.join(conf)}", f"--local-addr={net.local_addr}"]


# torch's rendezvous waits this long for the nodes to join (its join_timeout; the launcher sets none)
JOIN_TIMEOUT_S = 600.0


def wait_for_store(
    host: str, port: int, timeout: float = JOIN_TIMEOUT_S, interval: float = 0.5, say=print
) -> bool:
    """Until the rendezvous store at host:port accepts a TCP connection (polled every `interval` s,
    at most `timeout` s); whether it did. A joining node runs this before torch's rendezvous: torch's
    store client retries a refused connection with exponential backoff (500 ms, x1.5, jitter, up to
    60 s), so a node started ~25 s before node 0 next tried 8-19 s after the store came up -- past
    node 0's last call (launch.rdzv_last_call_s), and node 0's first round ran without it (measured
    under load, test_multihost's lost host). Polled, it connects within `interval` of the store."""
    started = time.monotonic()
    waiting = False
    while True:
        try:
            socket.create_connection((host, port), timeout=2.0).close()  # (2 s: a dropped SYN)
            if waiting:
                say(
                    f"the rendezvous store at {host}:{port} answered after {time.monotonic() - started:.1f} s"
                )
            return True
        except OSError as err:
            if time.monotonic() - started >= timeout:
                say(f"the rendezvous store at {host}:{port} did not answer in {timeout:.0f} s ({err})")
                return False
            if not waiting:
                say(f"waiting for the rendezvous store at {host}:{port} (node 0 hosts it): {err}")
                waiting = True
        time.sleep(interval)


def interface_env(net: NodeNet, environ) -> dict[str, str]:
    """The interface variables to add: each one the user did not set, when the interface is known."""
    if net.loopback or net.iface is None:
        return {}
    return {var: net.iface for var in IFNAME_VARS if not environ.get(var)}


def describe(net: NodeNet, env) -> str:
    """One line saying how this node joins the job (written to logs/launcher.log)."""
    role = "hosts the rendezvous store" if net.is_host else "joins the rendezvous store"
    ifnames = " ".join(f"{v}={env[v]}" for v in IFNAME_VARS if env.get(v))
    return (
        f"fleetwise node network: endpoint {net.endpoint_ip}, this node {role}; "
        f"local address {net.local_addr} on {net.iface or '?'}; {ifnames or 'no interface variables'}"
    )


def network_problems(cfg) -> list:
    """A multi-node job whose rendezvous endpoint this node cannot resolve or route to is refused
    before anything starts (torch would retry for minutes and then fail with a store timeout)."""
    from fleetwise.config.problems import Problem

    try:
        node_network(cfg.launch.rdzv_endpoint)
    except NetworkError as err:
        return [
            Problem(
                "launch.rdzv_endpoint",
                f"rdzv_endpoint={cfg.launch.rdzv_endpoint}: {err}",
                "set launch.rdzv_endpoint=<node 0's address on the cluster network>:<port> on every node",
            )
        ]
    return []
