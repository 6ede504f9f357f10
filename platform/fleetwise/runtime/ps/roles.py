"""Who is who in a parameter-server launch, and how RPC is started.

Role mapping (one torchrun launch of num_trainers + num_servers processes):

    global rank 0 .. T-1        trainer 0 .. T-1      RPC name "trainer<t>"
    global rank T .. T+S-1      server  0 .. S-1      RPC name "server<s>"

Trainers come first so that global rank 0 is trainer 0, the process that writes metrics.jsonl and
talks to tracking, as rank 0 does in every collective strategy.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime

from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy


@dataclass(frozen=True)
class Role:
    kind: str  # "trainer" | "server"
    index: int  # trainer or server number
    rank: int  # global rank
    world_size: int

    @property
    def name(self) -> str:
        return f"{self.kind}{self.index}"

    @property
    def is_trainer(self) -> bool:
        return self.kind == "trainer"


def trainer_name(t: int) -> str:
    return f"trainer{t}"


def server_name(s: int) -> str:
    return f"server{s}"


def role_of(s: PSStrategy, rank: int, world_size: int) -> Role:
    expected = s.num_trainers + s.num_servers
    if world_size != expected:
        raise RuntimeError(
            f"strategy=ps needs num_trainers({s.num_trainers}) + num_servers({s.num_servers}) = {expected} "
            f"processes, but WORLD_SIZE={world_size}: launch with --nproc-per-node {expected}"
        )
    if rank < s.num_trainers:
        return Role("trainer", rank, rank, world_size)
    return Role("server", rank - s.num_trainers, rank, world_size)


def role_from_env(cfg: RunConfig) -> Role:
    s = cfg.strategy
    assert isinstance(s, PSStrategy)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as err:
        raise RuntimeError(
            f"{err.args[0]} is not set: run the parameter server under torchrun "
            "(fleetwise train strategy=ps starts it)"
        ) from None
    return role_of(s, rank, world)


def interface_of(address: str) -> str | None:
    """The local network interface that carries `address` (None when it is not a local address)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def init_rpc(cfg: RunConfig, role: Role) -> float:
    """Start this process's TensorPipe RPC agent; returns the seconds it took.

    TensorPipe listens on the interface named by TP_SOCKET_IFNAME (it has no bind-address option),
    so `strategy.server_address` is turned into its interface: loopback (127.0.0.1 -> lo) by
    default, which keeps every socket of a one-node job off the network. An address that is not
    local to this host (trainers on another node) leaves TensorPipe's own choice in place. Across
    nodes (launch.nnodes > 1) the launcher's TP_SOCKET_IFNAME -- the interface on the route to the
    rendezvous endpoint, or the user's -- is kept.
    The rendezvous goes through torchrun's store (env://, MASTER_ADDR/MASTER_PORT).
    """
    import torch.distributed.rpc as rpc

    s = cfg.strategy
    assert isinstance(s, PSStrategy)
    if cfg.launch.nnodes != "1" and os.environ.get("TP_SOCKET_IFNAME"):
        iface = None  # across nodes: the interface of the route to the rendezvous (the launcher's)
    else:
        iface = interface_of(s.server_address)
    if iface is not None:
        os.environ["TP_SOCKET_IFNAME"] = iface
    elif not os.environ.get("TP_SOCKET_IFNAME"):
        log(
            role,
            f"server_address {s.server_address} is not local to this host; TensorPipe picks the interface",
        )
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16,
        # A sync step waits at the server for the slowest trainer: the same bound as a collective.
        rpc_timeout=cfg.launch.collective_timeout_s,
        init_method="env://",
        # TCP (libuv) only: TensorPipe's shared-memory transport busy-polls one reactor thread per
        # process, which on a host with fewer cores than processes starves the real work (RTT of
        # a pull measured 4-17 ms with it vs 2-3 ms without, 4 processes on 2 cores).
        _transports=["uv"],
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # torch's own init_rpc gathers its device maps through a gloo group and trips its own
        # deprecation notice (torch 2.13, distributed_c10d._get_object_coll_device): nothing a user
        # of fleetwise can act on, printed by every process of every ps job
        warnings.filterwarnings("ignore", message=r"You are using a Backend .* as a ProcessGroup")
        rpc.init_rpc(role.name, rank=role.rank, world_size=role.world_size, rpc_backend_options=options)
    return time.perf_counter() - t0


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def log(role: Role | str, msg: str) -> None:
    who = role.name if isinstance(role, Role) else role
    print(f"{datetime.now():%H:%M:%S.%f}"[:-3] + f" [{who}] {msg}", file=sys.stdout, flush=True)
