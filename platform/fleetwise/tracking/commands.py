"""`fleetwise ui | compare | sync`: argv in, exit code out. mlflow loads inside the commands only."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from fleetwise.runtime.lifeline import stop_signals
from fleetwise.tracking.store import artifact_root, tracking_uri

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_EXPERIMENT = "fleetwise"  # conf/config.yaml: tracking.experiment


# ------------------------------------------------------------------------------------------------
# fleetwise ui


def ui_command(uri: str, host: str, port: int) -> list[str]:
    """The `mlflow server` command line serving the local store (one worker: it starts ~2x faster
    than MLflow's default of four and one user browsing needs no more)."""
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if root := artifact_root(uri):
        cmd += ["--artifacts-destination", str(root)]
    return [*cmd, "--workers", "1"]


def ui_env() -> dict[str, str]:
    """MLflow's GenAI job runner (eight more processes, each importing mlflow) does nothing
    for training runs and doubles the start-up time: off unless the user turned it on."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"} | dict(os.environ)


def cmd_ui(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fleetwise ui", description="Browse the tracked runs in the MLflow UI.")
    p.add_argument("--port", type=int, default=5000, help="port to serve on (default 5000)")
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)"
    )
    args = p.parse_args(argv)
    console, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
    uri = tracking_uri()
    if uri.startswith(("http://", "https://", "databricks")):
        console.print(f"Runs are tracked by the server {uri} (MLFLOW_TRACKING_URI): open it in a browser.")
        return EXIT_OK
    if not _port_free(args.host, args.port):
        err.print(
            f"[bold red]✗ port {args.port} on {args.host} is in use.[/] fix: fleetwise ui --port {args.port + 1}",
            highlight=False,
        )
        return EXIT_FAIL
    url = f"http://{args.host}:{args.port}"
    _reap_local(uri, err)
    console.print(f"Starting the MLflow UI for {uri} ...", highlight=False)
    # Its own session, so that we decide how it stops (and stop all of its workers).
    proc = subprocess.Popen(ui_command(uri, args.host, args.port), env=ui_env(), start_new_session=True)
    # Ctrl-C, SIGTERM and SIGHUP stop it. SIGINT is installed explicitly: started in the
    # background by a non-interactive shell (`make test &`), Python inherits SIGINT ignored and
    # Ctrl-C did nothing (the cause of the Ctrl-C test failing in a full suite run only).
    with stop_signals():
        try:
            ready = False
            while proc.poll() is None:
                if not ready and _answers(url + "/health"):
                    ready = True
                    console.print(f"[bold green]MLflow UI: {url}[/]  (Ctrl-C to stop)", highlight=False)
                time.sleep(0.5)
            err.print(
                f"[bold red]✗ the MLflow server exited with code {proc.returncode}[/] (its output is above)"
            )
            return EXIT_FAIL
        except KeyboardInterrupt:
            console.print("stopping the MLflow UI")
            return EXIT_OK
        finally:
            _stop_group(proc)


def _reap_local(uri: str, err: Console) -> None:
    """Before the UI shows them: runs whose launcher was killed marked KILLED (not RUNNING forever).
    Only a store that exists: a fresh one has no runs, and creating it here would race the server."""
    from fleetwise.tracking.store import describe

    if not uri.startswith("sqlite:///") or not Path(uri[len("sqlite:///") :]).is_file():
        return
    from fleetwise.tracking.run_tracker import reap_orphans
    from fleetwise.tracking.store import client

    try:
        reap_orphans(client(uri), uri, notify=lambda m: err.print(f"fleetwise: {m}", highlight=False))
    except Exception as exc:  # noqa: BLE001 - the UI still shows the runs
        err.print(f"fleetwise: could not check the store's RUNNING runs: {describe(exc)}", highlight=False)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _stop_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ------------------------------------------------------------------------------------------------
# fleetwise compare


def cmd_compare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="fleetwise compare",
        description="Compare runs: throughput, MFU, peak vs predicted memory, final loss; writes a PNG chart.",
    )
    p.add_argument(
        "run_ids", nargs="*", metavar="RUN_ID", help="runs to compare (a sweep's parent: its children)"
    )
    p.add_argument(
        "--experiment",
        "-e",
        help=f"compare the newest runs of this experiment (default {DEFAULT_EXPERIMENT})",
    )
    p.add_argument(
        "--out", "-o", type=Path, default=Path("compare.png"), help="chart path (default ./compare.png)"
    )
    p.add_argument(
        "--limit", type=int, default=20, help="at most this many runs of the experiment (default 20)"
    )
    args = p.parse_args(argv)
    err = Console(stderr=True, soft_wrap=True)
    if args.run_ids and args.experiment:
        err.print("[bold red]✗ give run ids or --experiment, not both[/]")
        return EXIT_USAGE

    from fleetwise.tracking.compare import add_loss_curves, find_runs, rich_table, row_from_run, write_chart
    from fleetwise.tracking.run_tracker import reap_orphans
    from fleetwise.tracking.store import client, describe

    uri = tracking_uri()
    experiment = args.experiment or DEFAULT_EXPERIMENT
    try:
        reap_orphans(client(uri), uri, notify=lambda m: err.print(f"fleetwise: {m}", highlight=False))
        runs = find_runs(client(uri), experiment=experiment, run_ids=args.run_ids, limit=args.limit)
    except Exception as exc:
        err.print(f"[bold red]✗ could not read runs from {uri}:[/] {describe(exc)}", highlight=False)
        return EXIT_FAIL
    if not runs:
        where = f"experiment {experiment!r}" if not args.run_ids else "the given run ids"
        err.print(
            f"[bold red]✗ no runs in {where} at {uri}.[/] fix: train one (fleetwise train ...), pick "
            "another experiment with --experiment, or set MLFLOW_TRACKING_URI to the store you used",
            highlight=False,
        )
        return EXIT_FAIL
    rows = add_loss_curves(client(uri), [row_from_run(r) for r in runs])
    title = f"{len(rows)} runs" + ("" if args.run_ids else f" of experiment {experiment!r}")
    # Piped into a file or a CI log there is no terminal width to respect: never squash the table.
    out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    out.print(rich_table(rows, title=title))
    chart = write_chart(rows, args.out, title=title)
    out.print(f"chart: {chart.resolve()}", highlight=False)
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# fleetwise sync


def find_run_dirs(root: Path) -> list[Path]:
    """Run dirs under root/outputs and root/multirun whose tracking.json says MLflow lacks something."""
    from fleetwise.rundir import TRACKING_FILE
    from fleetwise.tracking.spool import is_behind

    found = []
    for top in (root / "outputs", root / "multirun"):
        if top.is_dir():
            found += sorted(p.parent for p in top.rglob(TRACKING_FILE) if is_behind(p.parent))
    return found


def cmd_sync(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="fleetwise sync",
        description="Deliver metrics, params, artifacts and final status that did not reach MLflow "
        "(server down during the run). Default: every run dir under ./outputs and ./multirun that is behind.",
    )
    p.add_argument("run_dirs", nargs="*", type=Path, metavar="RUN_DIR")
    args = p.parse_args(argv)
    console, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)

    from fleetwise.rundir import TRACKING_FILE
    from fleetwise.tracking.spool import is_behind, load_state

    run_dirs = args.run_dirs or find_run_dirs(Path.cwd())
    if not run_dirs:
        console.print("nothing to sync: every run under ./outputs and ./multirun is in MLflow")
        return EXIT_OK
    missing = [d for d in run_dirs if not (d / TRACKING_FILE).exists()]
    if missing:
        err.print(
            f"[bold red]✗ not a tracked run dir (no {TRACKING_FILE}):[/] {', '.join(map(str, missing))}",
            highlight=False,
        )
        return EXIT_USAGE

    from fleetwise.tracking.run_tracker import sync_run_dir

    behind = 0
    for run_dir in run_dirs:
        delivered = sync_run_dir(run_dir, notify=lambda m: err.print(f"  {m}", highlight=False))
        state = load_state(run_dir)
        late = is_behind(run_dir)
        behind += late
        mark = "[yellow]… still behind[/]" if late else "[green]✓ in sync[/]"
        console.print(
            f"{mark} {run_dir}: {delivered} steps delivered, run {state.run_id or '-'} "
            f"({(state.final or {}).get('status', 'RUNNING')})",
            highlight=False,
        )
    return EXIT_FAIL if behind else EXIT_OK
