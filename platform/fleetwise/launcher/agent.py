"""torchrun, with every store it hosts listening on loopback only (single node), and telling the
ranks the rendezvous round of their group (every job).

`python -m fleetwise.launcher.agent TORCHRUN_ARGS…` is `python -m torch.distributed.run` except that
torch's TCPStore servers (the c10d rendezvous store and the store the ranks share) listen on
127.0.0.1. torch binds them to every interface whatever host it is given, and they are
unauthenticated: on a single-node job anyone who reaches the machine could join the rendezvous or
write the keys the ranks read. TCPStore accepts an already-listening socket (`master_listen_fd`);
this module hands it one bound to loopback. Multi-node jobs need a reachable store
(`--any-interface`, the first argument: torch's binds; trusted network, see the README).

Every group the agent starts gets FLEETWISE_RDZV_ROUND (runtime/mesh.py's ROUND_VAR): the round is
the same on every node, 0 only for the job's first group, so a group re-formed because a lost node
came back -- which torch does not count as a restart -- still resumes from the checkpoint.
"""

from __future__ import annotations

import os
import socket
import sys

LOOPBACK = "127.0.0.1"
_ARGS = (
    "host_name",
    "port",
    "world_size",
    "is_master",
    "timeout",
    "wait_for_workers",
    "multi_tenant",
    "master_listen_fd",
    "use_libuv",
)
_listening: list[socket.socket] = []  # kept open for the life of the process: the stores use them


def loopback_store_class(base):
    class LoopbackTCPStore(base):
        def __init__(self, *args, **kwargs):
            kwargs.update(zip(_ARGS, args, strict=False))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((LOOPBACK, int(kwargs.get("port") or 0)))
                sock.listen(socket.SOMAXCONN)
                _listening.append(sock)
                kwargs.update(host_name=LOOPBACK, port=sock.getsockname()[1], master_listen_fd=sock.fileno())
                kwargs["use_libuv"] = True  # the libuv server takes the socket as it is
            super().__init__(**kwargs)

    LoopbackTCPStore.__name__ = LoopbackTCPStore.__qualname__ = "TCPStore"
    return LoopbackTCPStore


def install() -> None:
    """Make the stores torchrun's agent creates listen on loopback."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    store = loopback_store_class(dist.TCPStore)
    dist.TCPStore = store  # dynamic_rendezvous: the store shared with the ranks
    c10d_rendezvous_backend.TCPStore = store  # the rendezvous store


def export_round() -> None:
    """Before each group starts, its rendezvous round into the environment the ranks inherit."""
    from fleetwise.compat import after_each_rendezvous, rendezvous_round
    from fleetwise.runtime.mesh import ROUND_VAR

    def export(worker_group) -> None:
        os.environ[ROUND_VAR] = str(rendezvous_round(worker_group))

    after_each_rendezvous(export)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--any-interface"]:
        del sys.argv[1]
    else:
        install()
    export_round()
    from torch.distributed.run import main

    main()
