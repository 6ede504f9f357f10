"""Warm launchers for the suite: `run_cli`'s `fleetwise` forked from a process that has imported it.

A `fleetwise train` launcher imports the CLI, Hydra and the planner (~0.8 CPU-s) and composes the
config a first time with cold caches (~0.35 s more); a tracked one also imports MLflow, its SQL
store and torch (~6 s: it logs the model at the end). The suite starts hundreds of launchers.
With a warm pool (the agent pool's directory, launcher/agent_pool.py: FLEETWISE_AGENT_POOL, set
per test process by tests/conftest.py), `run_cli` asks a server there (this file run as a script:
those modules imported once, one config composed; agent_pool's server mechanism) to fork the
launcher; the fork runs exactly the console script's `fleetwise.cli:main(argv)` with the call's
environment, working directory, argv and stdout/stderr (pipes passed over the Unix socket), then
what an interpreter does at exit (non-daemon threads joined, atexit handlers), and exits with
main's code.

A server serves one `signature` (agent_pool.signature: the interpreter and the environment read at
start-up); a launcher forked for a call from other network or mount namespaces enters the caller's
(root only; agent_pool.enter_namespaces_of), elsewhere such a call runs a new interpreter. FLEETWISE_AGENT_POOL empty (the `cold_agents` fixture, the smoke test) or
FLEETWISE_TEST_COLD_AGENTS=1: the console script as a new interpreter, as users run it. Test code
only: the product never forks a launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleetwise.launcher import agent_pool

# What a launcher imports (a tracked one included), imported by the server before it forks any
PRELOAD = [
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
]
SERVER = [sys.executable, __file__, "--serve"]


def run_pooled(exe: Path, args: tuple[str, ...], cwd: Path | None, timeout: float, env: dict[str, str]):
    """`[exe, *args]` forked from the warm launcher pool: a CompletedProcess as subprocess.run's
    (capture_output, text) would return, or None where no pool serves this call."""
    directory = agent_pool.pool_directory(env)
    if directory is None:
        return None
    path = directory / f"cli-{agent_pool.signature(env)}.sock"
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        request = {"argv": list(args), "env": env, "cwd": str(cwd or os.getcwd()), "namespaces_of": os.getpid()}
        try:
            forked = agent_pool.request_fork(path, SERVER, env, request, [out_w, err_w])
        finally:  # the child holds its own copies: EOF on the pipes is its end
            os.close(out_w)
            os.close(err_w)
        if forked is None:  # a server just started failed: a bug here, not to be hidden by slow tests
            log = path.with_suffix(".log")
            raise RuntimeError(f"the warm launcher pool does not answer; {log}:\n{log.read_text()[-3000:]}")
        conn, pid = forked
        with conn:
            stdout, stderr = _read_until_eof(out_r, err_r, timeout, pid, [str(exe), *args])
            returncode = int(json.loads(agent_pool.read_line(conn))["returncode"])
        return subprocess.CompletedProcess([str(exe), *args], returncode, stdout, stderr)
    finally:
        os.close(out_r)
        os.close(err_r)


def _read_until_eof(out_r: int, err_r: int, timeout: float, pid: int, cmd: list[str]) -> tuple[str, str]:
    """Both pipes to their end (as subprocess.run's communicate); past `timeout` the launcher is
    killed and TimeoutExpired raised, as subprocess.run does."""
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
    return out, err


# --- the server's child: a launcher ---


def _launcher(request: dict) -> None:
    """The console script as it starts (its directory first on sys.path, its argv), main(argv),
    then what the interpreter does at exit; never returns."""
    code: object = 1
    try:
        sys.path[0] = str(Path(sys.executable).parent)
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
        os._exit(_exit_status(code))


def _exit_status(code: object) -> int:
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
        atexit._run_exitfuncs()  # the standard library's, no public accessor (as launcher/agent.py)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return status


if __name__ == "__main__":  # python tests/helpers/cli_pool.py --serve SOCKET OWNER
    from fleetwise.config.validate import load_config

    load_config(["recipe=gpt/tiny"])  # Hydra's plugin discovery and first composition, once
    agent_pool.serve(sys.argv[2], int(sys.argv[3]), PRELOAD, _launcher, fds=2)
