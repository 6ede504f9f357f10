"""Warm launchers for the suite: `run_cli`'s `fleetwise` forked from a process that has imported it.

A `fleetwise train` launcher imports the CLI, Hydra and the planner (~0.8 CPU-s) and composes the
config a first time with cold caches (~0.35 s more); a tracked one also imports MLflow, its SQL
store and torch (~6 s: it logs the model at the end). The suite starts hundreds of launchers.
With a warm pool (the agent pool's directory, launcher/agent_pool.py: FLEETWISE_AGENT_POOL, set
per test process by tests/conftest.py), `run_cli` asks a server process there (this file run as a
script: those modules imported once, one config composed) to fork the launcher; the fork runs
exactly the console script's `fleetwise.cli:main(argv)` with the call's environment, working
directory, argv and stdout/stderr (pipes passed over the Unix socket), then what an interpreter
does at exit (non-daemon threads joined, atexit handlers), and exits with main's code.

As for agents, a server serves one `signature` (agent_pool.signature: the interpreter and the
environment read at start-up, plus the locale, which picks stdout's encoding), and a call from
other network or mount namespaces than the pool's owner runs a new interpreter. FLEETWISE_AGENT_POOL
empty (the `cold_agents` fixture, the smoke test) or FLEETWISE_TEST_COLD_AGENTS=1: the console
script as a new interpreter, as users run it. Test code only: the product never forks a launcher.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

POOL_VAR = "FLEETWISE_AGENT_POOL"
START_TIMEOUT_S = 120.0
# What a launcher imports (a tracked one included), imported by the server before it forks any: a
# missing name is skipped (the list only saves time)
PRELOAD = (
    "fleetwise.cli",
    "fleetwise.launcher.sweeps",
    "fleetwise.launcher.preflight",
    "fleetwise.launcher.job",
    "fleetwise.launcher.torchrun",
    "fleetwise.launcher.failure",
    "fleetwise.plan.render",
    "fleetwise.tracking.run_tracker",
    "fleetwise.tracking.models",
    "fleetwise.tracking.summary",
    "hydra.experimental.callback",
    "rich.progress",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "torch",
    "fleetwise.runtime.checkpoint",
    "fleetwise.runtime.modeling",
)


def _signature(env: dict[str, str]) -> str:
    from fleetwise.launcher.agent_pool import signature

    return signature(
        {**env, **{f"PYTHON_LOCALE_{k}": v for k, v in env.items() if k.startswith(("LC_", "LANG"))}}
    )


def _pool_for(env: dict[str, str]) -> Path | None:
    from fleetwise.launcher.agent_pool import NAMESPACES_FILE, OWNER_FILE, namespaces

    directory = env.get(POOL_VAR)
    if not directory or not Path(directory, OWNER_FILE).exists():
        return None
    if json.loads(Path(directory, NAMESPACES_FILE).read_text()) != namespaces():
        return None
    return Path(directory)


def run_pooled(exe: Path, args: tuple[str, ...], cwd: Path | None, timeout: float, env: dict[str, str]):
    """`[exe, *args]` forked from the warm launcher pool: a CompletedProcess as subprocess.run's
    (capture_output, text) would return, or None where no pool serves this call."""
    directory = _pool_for(env)
    if directory is None:
        return None
    path = directory / f"cli-{_signature(env)}.sock"
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    request = json.dumps({"argv": list(args), "env": env, "cwd": str(cwd or os.getcwd())}).encode()
    conn = None
    try:
        for attempt in range(2):
            if attempt or not path.exists():
                _start_server(path, env)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(str(path))
                socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [out_w, err_w])
                pid = int(json.loads(_line(conn))["pid"])
                break
            except (OSError, ValueError):  # a stale socket (its server killed): start a new one once
                conn.close()
                conn = None
        if conn is None:  # a server just started failed: a bug here, not to be hidden by slow tests
            log = path.with_suffix(".log")
            raise RuntimeError(f"the warm launcher pool does not answer; {log}:\n{log.read_text()[-3000:]}")
        os.close(out_w)
        os.close(err_w)
        out_w = err_w = -1
        stdout, stderr = _read_until_eof(out_r, err_r, timeout, pid, exe, args)
        returncode = int(json.loads(_line(conn))["returncode"])
        return subprocess.CompletedProcess([str(exe), *args], returncode, stdout, stderr)
    finally:
        for fd in (out_r, err_r, out_w, err_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if conn is not None:
            conn.close()


def _line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(4096)
        if not part:
            raise ConnectionError("the launcher pool closed the connection")
        data += part
    return data


def _read_until_eof(out_r: int, err_r: int, timeout: float, pid: int, exe: Path, args) -> tuple[str, str]:
    """Both pipes to their end (as subprocess.run's communicate); past `timeout` the launcher is
    killed and TimeoutExpired raised, as subprocess.run does."""
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    open_fds = set(chunks)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired([str(exe), *args], timeout)
        for key, _ in sel.select(left):
            data = os.read(key.fd, 1 << 16)
            if data:
                chunks[key.fd].append(data)
            else:
                sel.unregister(key.fd)
                open_fds.discard(key.fd)
    sel.close()
    return tuple(b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))  # type: ignore[return-value]


def _start_server(path: Path, env: dict[str, str]) -> None:
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
                probe.connect(str(path))
                return  # another test process's call started it meanwhile
            path.unlink()
        owner = Path(path.parent, "owner").read_text().strip()
        with open(path.with_suffix(".log"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", str(path), owner],
                env=env,
                cwd=path.parent,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # the pool's closing (agent_pool.close_pool) kills every *.pid of its directory
        path.with_suffix(".pid").write_text(str(proc.pid))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)


# --- the server (run as a script; imports what a launcher imports) ---


def serve(path: str, owner: int) -> None:
    import importlib
    import threading

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    from fleetwise.config.validate import load_config

    load_config(["recipe=gpt/tiny"])  # Hydra's plugin discovery and first composition, once
    if threading.active_count() != 1:  # a fork copies only the forking thread
        print(f"cli pool: {threading.enumerate()} after the imports; not serving", flush=True)
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
                pid = _fork_launcher(conn, listener)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
            except (OSError, ValueError):
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


def _fork_launcher(conn: socket.socket, listener: socket.socket) -> int:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    (size,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise ConnectionError("short request")
        data += part
    request = json.loads(data)
    out_fd, err_fd = fds
    pid = os.fork()
    if pid:
        os.close(out_fd)
        os.close(err_fd)
        return pid
    code: object = 1
    try:  # the launcher: never back into the server's loop
        listener.close()
        conn.close()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = str(Path(sys.executable).parent)  # a console script's directory, as it starts
        sys.argv = [str(Path(sys.executable).parent / "fleetwise"), *request["argv"]]
        from fleetwise.cli import main

        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(_exit(code))
    return 0  # unreachable


def _exit(code: object) -> int:
    """What the interpreter does after the console script's `sys.exit(main())`: print a string
    code, join the non-daemon threads, run the atexit handlers, flush; the exit status."""
    import atexit
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    with contextlib.suppress(BaseException):
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return status


if __name__ == "__main__":
    serve(sys.argv[2], int(sys.argv[3]))
