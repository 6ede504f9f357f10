"""torchrun, with every store it hosts listening on the one address the job needs, and telling the
ranks the rendezvous round of their group (every job).

`python -m fleetwise.launcher.agent --bind=ADDR TORCHRUN_ARGS…` is `python -m torch.distributed.run`
except that torch's TCPStore servers (the c10d rendezvous store and the store the ranks share)
listen on ADDR: 127.0.0.1 for a single-node job, this node's address on the route to the
rendezvous endpoint for a multi-node one (fleetwise/hostnet.py). torch binds them to every
interface whatever host it is given, and they are unauthenticated: anyone who reaches any of the
machine's networks could join the rendezvous or write the keys the ranks read. TCPStore accepts an
already-listening socket (`master_listen_fd`); this module hands it one bound to ADDR
(runtime/mesh.py's `listening_socket`, which rank 0's own store uses too).

`--wait-for=HOST:PORT` (a node that does not host the rendezvous store): before torchrun, wait for
node 0's store to answer, polling every 0.5 s (fleetwise/hostnet.py `wait_for_store`): torch's own
client backs off to tries many seconds apart, and a node started well before node 0 missed its first
round.

Every group the agent starts gets FLEETWISE_RDZV_ROUND (runtime/mesh.py's ROUND_VAR): the round is
the same on every node, 0 only for the job's first group, so a group re-formed because a lost node
came back -- which torch does not count as a restart -- still resumes from the checkpoint.

The ranks are forked from a fork server that imported torch and the runtime once (`fork_ranks`),
not started as new interpreters that import them again (torchrun's `python -m WORKER RUN_DIR`): a
rank's imports cost ~5 s of CPU, which an 8-rank job on a 2-core machine paid 8 times before its
first step (measured: the demo's 8-rank layout, 3 steps, 46 s -> 25 s wall). The server is this
agent itself, forked once it has imported what the ranks need and before torchrun starts a thread
(`start_fork_server`): multiprocessing's own server would be one more interpreter importing torch
and the runtime again (~3 s of CPU a job, measured 6.3 CPU-s for the preload against 3.3 for the
agent's own imports).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import traceback
from typing import NoReturn

from fleetwise.runtime.lifeline import stop_fork_server

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
WORKER = "fleetwise.runtime.worker"
# What a rank imports before its first step (runtime/worker.py's imports, the trainer's, the engines'),
# imported once in the fork server.
PRELOAD = [
    WORKER,
    "fleetwise.runtime.trainer",
    "fleetwise.runtime.parallelize",
    "fleetwise.runtime.checkpoint",
    "fleetwise.families",
    "fleetwise.models.transformer",
    "fleetwise.runtime.hostmalloc",
    "fleetwise.data.tokens",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
]
# A forked rank's environment is the fork server's, which is the agent's when the server started
# (SERVER_ENV; the launcher's, OMP_NUM_THREADS included: launcher/torchrun.py), plus torch's
# per-rank variables. GROUP_ENV: what the agent's environment has gained or changed since (the
# group's rendezvous round), taken before each group starts and passed to every rank with its
# arguments (pickled when the rank starts) -- the environment a rank torchrun starts as a new
# process inherits.
SERVER_ENV: dict[str, str] = {}
GROUP_ENV: dict[str, str] = {}


def bound_store_class(base, address: str):
    class BoundTCPStore(base):
        def __init__(self, *args, **kwargs):
            kwargs.update(zip(_ARGS, args, strict=False))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                from fleetwise.runtime.mesh import listening_socket

                sock = listening_socket(address, int(kwargs.get("port") or 0))
                _listening.append(sock)
                kwargs.update(host_name=address, port=sock.getsockname()[1], master_listen_fd=sock.fileno())
                kwargs["use_libuv"] = True  # the libuv server takes the socket as it is
            super().__init__(**kwargs)

    BoundTCPStore.__name__ = BoundTCPStore.__qualname__ = "TCPStore"
    return BoundTCPStore


def install(address: str) -> None:
    """Make the stores torchrun's agent creates listen on `address` only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    store = bound_store_class(dist.TCPStore, address)
    dist.TCPStore = store  # dynamic_rendezvous: the store shared with the ranks
    c10d_rendezvous_backend.TCPStore = store  # the rendezvous store


def export_round() -> None:
    """Before each group starts, its rendezvous round into the environment the ranks inherit."""
    from fleetwise.compat import after_each_rendezvous, rendezvous_round
    from fleetwise.runtime.mesh import ROUND_VAR

    def export(worker_group) -> None:
        os.environ[ROUND_VAR] = str(rendezvous_round(worker_group))
        GROUP_ENV.clear()
        GROUP_ENV.update({k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v})

    after_each_rendezvous(export)


def start_fork_server() -> None:
    """Import PRELOAD here, then start the fork server the ranks are forked from: this process
    forked (`_fork_the_server`), or multiprocessing's own server importing PRELOAD again where that
    cannot be done (a thread already running, another Python's ForkServer).

    Process tree: agent -> fork server -> ranks, one session: the launcher's SIGTERM to the session
    reaches the ranks themselves. The agent ends the server before it exits (`stop_fork_server`),
    and the ranks die with it (runtime/worker.py: die_with_parent)."""
    import importlib
    import multiprocessing
    import threading
    from multiprocessing import forkserver

    for name in PRELOAD:
        importlib.import_module(name)
    from fleetwise.runtime.worker import FORK_SERVER_VAR

    here = threading.active_count() == 1 and _can_fork_the_server()
    os.environ[FORK_SERVER_VAR] = "the agent" if here else "a new interpreter"  # the ranks' start-up line
    SERVER_ENV.update(os.environ)
    if here:
        _fork_the_server()
    else:
        multiprocessing.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()


# multiprocessing's ForkServer client state in the Pythons whose server this agent can become
# (3.11, 3.12); 3.13 adds an authentication key exchanged at start-up, and others may differ
_FORK_SERVER_STATE = {
    "_forkserver_address",
    "_forkserver_alive_fd",
    "_forkserver_pid",
    "_inherited_fds",
    "_lock",
    "_preload_modules",
}


def _can_fork_the_server() -> bool:
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the stdlib's, no public accessor
    return set(vars(server)) == _FORK_SERVER_STATE and server._forkserver_pid is None


def _fork_the_server() -> None:
    """Become multiprocessing's fork server by forking: the child runs the stdlib's own server loop
    (`forkserver.main`) on a listening socket made here, and this process keeps the client's state
    as `ForkServer.ensure_running` does after starting a server -- its address, the write end of
    the pipe whose closing ends the server, its pid. Must run while this process has one thread (a
    fork copies no other thread, nor the locks they hold), and where this Python's ForkServer holds
    the state `_can_fork_the_server` knows."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = forkserver._forkserver  # the stdlib's, no public accessor
    resource_tracker.ensure_running()  # as ensure_running: the ranks share one tracker
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    sys.stdout.flush()  # nothing this agent has buffered may reach a rank's log through the fork
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the server: it ends when every holder of alive_w has gone (the agent)
        try:
            os.close(alive_w)
            forkserver.main(listener.detach(), alive_r, [])
        finally:
            os._exit(0)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    util.Finalize(None, os.unlink, args=(address,), exitpriority=0)  # the socket file, at exit


def fork_ranks() -> None:
    """Start fleetwise's ranks from the fork server (torch's multiprocessing start of a function
    entry point, method `forkserver`) instead of torchrun's `python -m WORKER RUN_DIR`."""
    from fleetwise.compat import launch_ranks_with, report_every_failed_worker

    def transform(config, entrypoint, args: list):
        if args[-3:-1] != ["-m", WORKER]:
            raise ValueError(f"fleetwise's agent starts {WORKER} only, not {args}")
        from fleetwise.runtime.worker import forked

        config.start_method = "forkserver"
        return forked, (args[-1], GROUP_ENV)

    launch_ranks_with(transform)
    report_every_failed_worker()


def run_torchrun() -> int:
    """torchrun's main in this process; its exit status, a failure's traceback on stderr as an
    uncaught exception would print it (the launcher reads the cause from the ranks' error files)."""
    from torch.distributed.run import main

    try:
        main()
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        stop_fork_server()


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown: with torch and the runtime imported, finalizing
    every module costs the agent 1-2 s of CPU after its ranks have ended, paid by every job (and
    the suite's hundreds). What an ordinary exit runs that matters still runs: the atexit handlers
    (logging's flush, multiprocessing's finalizers), then the standard streams' flush."""
    atexit._run_exitfuncs()  # the standard library's, no public accessor
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> NoReturn:
    """The agent of `python -m fleetwise.launcher.agent --bind=ADDR TORCHRUN_ARGS…` (sys.argv): a new
    interpreter, or forked from a warm pool process (launcher/agent_pool.py)."""
    from fleetwise.launcher import agent_pool

    start_fork_server()
    agent_pool.watch()  # a forked agent's launcher watch: a thread, so after the server's fork
    if not sys.argv[1].startswith("--bind="):
        raise SystemExit(f"usage: python -m {__name__} --bind=ADDR [--wait-for=HOST:PORT] TORCHRUN_ARGS...")
    install(sys.argv.pop(1).removeprefix("--bind="))
    if sys.argv[1].startswith("--wait-for="):  # a joining node: connect as soon as node 0's store is up
        from fleetwise.hostnet import wait_for_store

        host, _, port = sys.argv.pop(1).removeprefix("--wait-for=").rpartition(":")
        wait_for_store(
            host.strip("[]"), int(port), say=lambda line: print(f"fleetwise agent: {line}", flush=True)
        )
    export_round()
    fork_ranks()
    exit_now(run_torchrun())


if __name__ == "__main__":
    if sys.argv[1] == "--serve":  # a pool process: python -m fleetwise.launcher.agent --serve SOCKET OWNER
        from fleetwise.launcher.agent_pool import serve_agents

        # what the ranks import, and what this agent imports to run torchrun
        preload = [*PRELOAD, "torch.distributed.run", "fleetwise.compat", "fleetwise.runtime.mesh"]
        serve_agents(sys.argv[2], int(sys.argv[3]), preload, main)
    main()
