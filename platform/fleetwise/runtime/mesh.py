"""Process group start-up and the one 4D DeviceMesh every parallelism uses."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fleetwise.compat import flatten_mesh
from fleetwise.config.run import RunConfig

# The rendezvous round of this worker group, exported by fleetwise's torchrun agent: 0 for the
# job's first group, more for every group formed again -- after a failure (a restart) and after a
# membership change (a node came back), which torch does not count as a restart.
ROUND_VAR = "FLEETWISE_RDZV_ROUND"


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    restart: int  # torchrun's restart count of this worker group (0 on the first attempt)
    round: int = 0  # the rendezvous round (ROUND_VAR): > 0 whenever the group was formed again

    @property
    def regrouped(self) -> bool:
        """This group replaces an earlier one of the same job (resume from its checkpoint)."""
        return self.restart > 0 or self.round > 0


def exit_finished(code: int = 0) -> None:
    """Leave a process whose distributed work is done without the interpreter's teardown. A process
    group that outlives destroy_process_group (DDP's reducer, device meshes and cached subgroups
    keep references) is otherwise destroyed during finalization, where gloo's worker threads can
    abort the process ("terminate called without an active exception", pytorch/pytorch#179291):
    seen here in 1 of 32 two-rank DDP loops and 8 of 80 DTensor/FSDP calibrations. Logs and
    standard streams are flushed first; the caller has written and closed its files."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_distributed(cfg: RunConfig) -> DistEnv:
    """Join the process group torchrun prepared (env://), with the configured collective timeout:
    a collective that hangs (e.g. a peer died without the group noticing) becomes an error."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    exported = os.environ.get(ROUND_VAR)
    group_round = int(exported) if exported is not None else None
    if cfg.hardware.device_type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training uses TF32 (the planner's fp32 peak)
        torch.backends.cudnn.allow_tf32 = True
        # every step has the same shapes (fixed micro-batch): cuDNN's autotuning pays from step 2
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.launch.collective_timeout_s)
        dist.init_process_group(
            backend=process_group_backend(cfg),
            store=attempt_store(rank, world, attempt_prefix(restart, group_round), timeout),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return DistEnv(rank, world, local, device, restart, group_round or 0)


def attempt_prefix(restart: int, group_round: int | None) -> str:
    """The store prefix of a worker group's attempt (see attempt_store), the same on every node.

    From the rendezvous round alone: every node's agent reads the same round once the group is
    formed, and a group formed again (a restart, a node coming back) is a new round. Not from the
    restart count: each node's agent keeps its own. When a rank of node A dies, A's agent restarts
    its workers and counts 1; node B's agent sees A waiting at the rendezvous
    (`num_nodes_waiting`) and restarts its workers without counting. With the count in the
    prefix, A's ranks waited under attempt 1, B's under attempt 0: gloo's connections fail at
    once, but NCCL's ranks wait for peers that never come until the collective timeout (300 s).

    group_round None: no fleetwise agent exported a round (a plain torchrun), so the restart count
    is all there is (right on one node)."""
    if group_round is None:
        return f"restart_{restart}"
    return f"round_{group_round}"


def process_group_backend(cfg: RunConfig) -> str:
    """The backend string of the job's process group. NCCL reduces only CUDA tensors; FSDP2's CPU
    offload keeps gradients (and GradScaler's found_inf) on the host, where DTensor reduces them
    for the gradient norm and the overflow check. Such a job gets gloo for its CPU tensors beside
    NCCL for the rest, as torchtune does (cf. pytorch#148532)."""
    backend = cfg.hardware.backend
    if backend == "nccl" and getattr(cfg.strategy, "offload", False):
        return "cpu:gloo,cuda:nccl"
    return backend


def attempt_store(rank: int, world: int, attempt: str, timeout: timedelta) -> dist.Store:
    """The rendezvous store of this attempt, under a prefix of its own.

    Why: torchrun's c10d rendezvous shares one TCPStore (hosted by the agent) across restarts,
    and its workers connect to it without a per-attempt prefix. After a restart, the new ranks
    therefore find the previous attempt's keys -- among them the listening addresses gloo
    published for its full mesh. A new rank that reads a dead peer's stale address before the
    peer's successor overwrote it fails with "Gloo connectFullMesh failed ... Connection
    refused" (a race, hence the intermittent failures after a hard exit). A prefix per attempt
    (`attempt_prefix`) makes every attempt see only its own keys."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts = not agent_hosts and rank == 0  # a multi-node group: rank 0 hosts the ranks' store
    listen = {}
    if hosts:  # on MASTER_ADDR only (torch's own binds every interface; see launcher/agent.py)
        sock = listening_socket(host, port)
        _LISTENING.append(sock)
        listen = {"master_listen_fd": sock.fileno(), "use_libuv": True}
    store = dist.TCPStore(
        host,
        port,
        world_size=world,
        is_master=hosts,
        timeout=timeout,
        wait_for_workers=False,
        **listen,
    )
    return dist.PrefixStore(f"fleetwise/attempt_{attempt}", store)


_LISTENING: list[socket.socket] = []  # open for the life of the process: the stores serve on them


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address` only (port 0: a free one), for a TCPStore server
    (`master_listen_fd`). A port in use (or an address this machine lacks) raises torch's own
    DistNetworkError, as its TCPStore does: torch's rendezvous then joins as a client -- how the
    second node of a job whose nodes share one machine finds the first node's store."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise dist.DistNetworkError(f"cannot listen on {address}:{port}: {err}") from err
    return sock


_GROUPS: dict[tuple[str, ...], dist.ProcessGroup] = {}


def process_group(mesh: DeviceMesh, dims: tuple[str, ...]) -> dist.ProcessGroup:
    """The process group of one mesh dim, or of several flattened into one (created once,
    collectively by every rank, and cached: a new group per call would leak communicators)."""
    if len(dims) == 1:
        return mesh[dims[0]].get_group()
    if dims not in _GROUPS:
        _GROUPS[dims] = flatten_mesh(mesh, dims).get_group()
    return _GROUPS[dims]


def flattened_groups() -> dict[tuple[str, ...], dist.ProcessGroup]:
    """The process groups of flattened mesh dims made so far, by their dims (the dry run names them)."""
    return dict(_GROUPS)
