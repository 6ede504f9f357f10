"""Warm agents: a job's torchrun agent forked from a process that has already imported torch.

Every job starts one agent (launcher/agent.py), and before its first rank the agent imports torch,
torchrun and the runtime: ~4-5 s of CPU, most of a small job's cost (measured: a 2-rank gpt/tiny
job of 4 steps took 8.4 CPU-s -- the launcher 2.1, the agent 5.1, both ranks 1.1). A test suite
that starts hundreds of jobs pays it hundreds of times. With FLEETWISE_AGENT_POOL naming a
directory (`open_pool`), the launcher asks a pool process there (`python -m
fleetwise.launcher.agent --serve SOCKET`, torch imported once) to fork the agent instead of
starting a new interpreter; the fork then runs exactly what a new agent runs (agent.main).

What must be the same as in a new interpreter is: the environment read when the interpreter and
torch start (OpenMP's thread count and wait policy, glibc's malloc settings, Python's own
variables: `IMPORT_TIME_PREFIXES`) and the Python. A pool process serves one such `signature` (a
launch with another starts another pool process); the rest of the environment, the working
directory, the command line, the log file and the network and mount namespaces are the launch's
own: a launch on a test's host (another network namespace, entered by `ip netns exec`) gets an agent
forked here that enters the launcher's namespaces before anything else (`enter_namespaces_of`; root
only, as creating them is -- elsewhere such a launch starts its agent itself).
The agent forked here is the leader of its own session, as a new one is, and dies with its
launcher (SIGTERM once the launcher's pid is gone: a pidfd, since its parent is the pool process).

Without FLEETWISE_AGENT_POOL (what users run) nothing changes: the agent is a new interpreter.
The server mechanism (`request_fork`, `serve`) also forks the suite's `fleetwise` launchers
(tests/helpers/cli_pool.py), from a server of its own in the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

POOL_VAR = "FLEETWISE_AGENT_POOL"
# Environment variables a process reads as it starts or as torch loads; a forked agent inherits
# the pool process's reading of them, so a pool process serves only launches that agree on them.
IMPORT_TIME_PREFIXES = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
    "LD_",
    "PYTHON",
    "TORCH",
    "CUDA",
    "LANG",  # the locale picks stdout's encoding as the interpreter starts
    "LC_",
)
OWNER_FILE = "owner"  # the pid whose end ends the pool's processes
NAMESPACES_FILE = "namespaces"  # the owner's; a launch in others is served only where it can enter them
# setns(2)'s namespace types: a forked child joins its requester's network and mount namespaces
NAMESPACE_TYPES = {"net": 0x40000000, "mnt": 0x00020000}  # CLONE_NEWNET, CLONE_NEWNS
START_TIMEOUT_S = 120.0  # a pool process importing torch on a busy machine


# ... except these, read only later and set by torch itself in the process that reads them:
# inductor writes its cache directory into the environment the first time it asks for it
# (torch/_inductor/runtime/cache_dir_utils.py): a test process where anything had asked (after its
# first parity row) named it in every later launch, and each of those started a second launcher
# and agent pool process (~4 CPU-s of imports each) for the same interpreter and start-up.
SET_BY_TORCH_LATER = ("TORCHINDUCTOR_CACHE_DIR",)


def signature(env: dict[str, str]) -> str:
    """What a pool process must share with a launch for its fork to be that launch's agent."""
    same = {
        k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in SET_BY_TORCH_LATER
    }
    data = json.dumps([sys.executable, sys.path[1:], same], sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def namespaces(pid: int | str = "self") -> dict[str, str]:
    """The network and mount namespaces of `pid` (this process by default)."""
    out = {}
    for ns in NAMESPACE_TYPES:
        with contextlib.suppress(OSError):
            out[ns] = os.readlink(f"/proc/{pid}/ns/{ns}")
    return out


def enter_namespaces_of(pid: int) -> None:
    """Join `pid`'s network and mount namespaces where they are not this process's: a child forked
    for a launch on a test's host (`ip netns exec`) is then where a new interpreter started by that
    launcher would be -- its addresses, routes and /sys. Needs one thread (a fork's child has one)
    and root. The working directory is the new mount namespace's root after: the caller sets it."""
    mine, theirs = namespaces(), namespaces(pid)
    fds = {ns: os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY) for ns in NAMESPACE_TYPES if theirs[ns] != mine[ns]}
    try:
        for ns, fd in fds.items():
            _setns(fd, NAMESPACE_TYPES[ns])
    finally:
        for fd in fds.values():
            os.close(fd)
    if namespaces() != theirs:
        raise OSError(f"could not enter the namespaces of {pid}: {theirs}, here {namespaces()}")


def _setns(fd: int, nstype: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, nstype)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def open_pool(directory: Path) -> None:
    """Make `directory` a pool owned by this process: launches from processes that inherit this
    environment fork their agents from it (see `close_pool`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / NAMESPACES_FILE).write_text(json.dumps(namespaces()))
    (directory / OWNER_FILE).write_text(str(os.getpid()))
    os.environ[POOL_VAR] = str(directory)


def close_pool(directory: Path) -> None:
    """Stop the pool's processes (their agents run on, in their own sessions)."""
    for pid_file in directory.glob("*.pid"):
        with contextlib.suppress(ValueError, ProcessLookupError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    os.environ.pop(POOL_VAR, None)


class PooledAgent:
    """The launcher's handle on a forked agent: the part of subprocess.Popen launch_job uses."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid, self.returncode = conn, pid, None
        self._buf = b""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["agent", str(self.pid)], timeout)
            self._read(left)
        return self.returncode

    def _read(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self.conn], [], [], timeout)
        if not ready:
            return
        data = self.conn.recv(4096)
        if not data:  # the pool process died: its agent with it, or reparented and unwatched
            self.returncode = -signal.SIGKILL
            self.conn.close()
            return
        self._buf += data
        if b"\n" in self._buf:
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["returncode"])
            self.conn.close()


def pool_directory(env: dict[str, str]) -> Path | None:
    """The pool named by `env` that may serve this process (open; in its owner's network and mount
    namespaces, or in others as root, whose forked children can enter them: `enter_namespaces_of`);
    None: start a new interpreter."""
    directory = env.get(POOL_VAR)
    if not directory or not Path(directory, OWNER_FILE).exists():
        return None
    foreign = json.loads(Path(directory, NAMESPACES_FILE).read_text()) != namespaces()
    if foreign and (os.geteuid() != 0 or shutil.which("nsenter") is None):  # (`_start_server` uses it)
        return None
    return Path(directory)


def start_pooled(cmd: list[str], env: dict[str, str], log_fd: int) -> PooledAgent | None:
    """The agent of `cmd` (`python -m fleetwise.launcher.agent ARGS`) forked from this
    environment's pool, with `env`, the working directory of this process and stdout/stderr to
    `log_fd`; None where no pool is set (the caller starts a new interpreter)."""
    directory = pool_directory(dict(os.environ))
    if directory is None:
        return None
    me = os.getpid()
    request = {"argv": cmd[3:], "env": env, "cwd": os.getcwd(), "launcher": me, "namespaces_of": me}
    server = [sys.executable, "-m", "fleetwise.launcher.agent", "--serve"]
    forked = request_fork(directory / f"{signature(env)}.sock", server, env, request, [log_fd])
    return None if forked is None else PooledAgent(*forked)


def request_fork(
    path: Path, server: list[str], env: dict[str, str], request: dict, fds: list[int]
) -> tuple[socket.socket, int] | None:
    """Ask the pool server at `path` to fork a child for `request`, passing it `fds`; a missing or
    stale server (its process killed) is started first (`server` + [path, owner], with `env`), once.
    Returns the connection, on which the child's exit status arrives, and the child's pid; None
    when no server answers."""
    data = json.dumps(request).encode()
    for attempt in range(2):
        if attempt or not path.exists():
            _start_server(path, server, env)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(path))
            socket.send_fds(conn, [struct.pack("!I", len(data)) + data], fds)
            return conn, int(json.loads(read_line(conn))["pid"])
        except (OSError, ValueError):
            conn.close()
    return None


def read_line(conn: socket.socket) -> bytes:
    """One reply of a pool server (a JSON line), waiting for it."""
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(4096)
        if not part:
            raise ConnectionError("the pool process closed the connection")
        data += part
    return data


def _start_server(path: Path, server: list[str], env: dict[str, str]) -> None:
    """Start the pool server for `path`'s signature (one at a time: the lock), and wait for it."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
                probe.connect(str(path))
                return  # another launcher started it meanwhile
            path.unlink()
        owner = Path(path.parent, OWNER_FILE).read_text().strip()
        # a launcher on a test's host starts the server where the pool's owner is: a server in the
        # host's namespaces would outlive the job there (and die with the host)
        enter = []
        if json.loads(Path(path.parent, NAMESPACES_FILE).read_text()) != namespaces():
            enter = ["nsenter", f"--target={owner}", "--net", "--mount", f"--wd={path.parent}", "--"]
        with open(path.with_suffix(".log"), "ab") as log:
            proc = subprocess.Popen(
                [*enter, *server, str(path), owner],
                env=env,
                cwd=path.parent,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        path.with_suffix(".pid").write_text(str(proc.pid))  # close_pool kills every *.pid
        deadline = time.monotonic() + START_TIMEOUT_S
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)


# --- a pool server (imports once, then forks; `python -m fleetwise.launcher.agent --serve`) ---


def serve(path: str, owner: int, preload: list[str], child: Callable[[dict], object], fds: int = 1) -> None:
    """Import `preload`, then for each request on the socket at `path` fork a child that takes the
    request's environment, working directory and stdout/stderr (the request's `fds` file
    descriptors: one for both, or two) and runs `child(request)`; report its pid, then its exit
    status. End when `owner` does."""
    import importlib
    import threading

    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork copies the forking thread only
        print(f"pool server: threads {threading.enumerate()} after the imports; not serving", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bound under a short name, then renamed: a Unix socket's path is at most 107 bytes, and the
    # pool's directory may be a test's deep tmp_path
    tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}")
    listener.bind(tmp)
    listener.listen(16)
    os.rename(tmp, path)  # appears ready
    waiting: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener], [], [], 0.2)
        if ready:
            conn, _ = listener.accept()
            try:
                pid = _fork(conn, listener, child, fds)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
            except (OSError, ValueError):  # a torn request, or a launcher gone meanwhile
                conn.close()
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(
                        json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n"
                    )
                conn.close()
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os._exit(0)


def _fork(conn: socket.socket, listener: socket.socket, child: Callable[[dict], object], nfds: int) -> int:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, nfds)
    if len(data) < 4:  # a probe (`_start_server`: is the server up?) sends nothing
        raise ConnectionError("no request")
    (size,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise ConnectionError("short request")
        data += part
    request = json.loads(data)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    try:  # the child: never back into the server's loop
        # Every object inherited from the server (torch, MLflow, the CLI: all it imported) out of the
        # collector's generations (O(1)): a full collection would walk them all, writing each header,
        # and so copy every inherited page. They live as long as the child anyway. Measured: a
        # pooled launcher (gpt/tiny, 2 ranks) 0.82 -> 0.47 CPU-s; a rank forked from the agent's
        # fork server or a dry run's rank showed no difference (their steps dominate).
        gc.freeze()
        listener.close()
        conn.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[-1], 2)
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if request.get("namespaces_of"):  # the requester's host (a test's network namespace)
            enter_namespaces_of(int(request["namespaces_of"]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        child(request)
    except Exception:  # the child's own failure, in the log it was given (its exit is 1)
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)


def serve_agents(path: str, owner: int, preload: list[str], run_agent: Callable[[], object]) -> None:
    """The agent pool server: each child is an agent (`run_agent()`, reading the request's argv)."""

    def agent(request: dict) -> None:
        os.setsid()  # the leader of its own session, as a new agent is (launch_job kills the group)
        sys.path[0] = request["cwd"]  # as `python -m` sets it
        sys.argv = [sys.argv[0], *request["argv"]]
        _die_with(int(request["launcher"]))
        run_agent()

    serve(path, owner, preload, agent)


def _die_with(launcher: int) -> None:
    """SIGTERM this agent once the launcher is gone, as PR_SET_PDEATHSIG does for an agent the
    launcher started itself. The watch is a pidfd read by a thread started only after the agent
    has forked its own fork server (agent.main calls `watch` then): that fork must be the only
    thread's."""
    try:
        fd = os.pidfd_open(launcher)
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (OSError, AttributeError):
        return
    global _WATCH_FD
    _WATCH_FD = fd


_WATCH_FD: int | None = None


def watch() -> None:
    """Start the launcher watch `_die_with` prepared (a no-op in a new-interpreter agent)."""
    if _WATCH_FD is None:
        return
    import threading

    def wait_for_launcher(fd: int) -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_for_launcher, args=(_WATCH_FD,), daemon=True, name="launcher-watch").start()
