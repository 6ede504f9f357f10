"""What the console says when a job fails: the root cause first, the peers' echoes folded.

When one rank dies, its peers fail too, with gloo's "Connection closed by peer" and a long
traceback that says nothing about the cause. Rank 0's log is what the console follows, so those
tracebacks used to scroll past before the one line that matters. `TracebackFold` holds a
traceback back from the console (it stays in logs/rank_N.log); `failure_report` then leads with
the rank that caused the failure, names the held traceback in one line when it is only an echo
(printed whole when rank 0 is the cause), and gives the command that resumes the job from its
last checkpoint. `root_cause` finds that rank in torchrun's report and the ranks' error files.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

from fleetwise import rundir
from fleetwise.config.run import RunConfig

_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_SOURCE = re.compile(r"\[[^\]\s]*\.(cc|cpp|h):\d+\]\s*")  # gloo's "[/path/pair.cc:553] "
# a fleetwise log line (a rank's "2026-11-24 05:00:00,000 rank0 …", a ps role's "05:00:00.000 [trainer0] …"):
# always shown, also after a traceback that was held
_LOG_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d[.,]\d{3} ")


class TracebackFold:
    """Feeds rank 0's log lines to the console, holding back every line from a traceback's start on
    (except fleetwise's own log records)."""

    def __init__(self) -> None:
        self.held: list[str] = []

    def feed(self, line: str) -> str | None:
        """The line to print, or None when it is held."""
        if _LOG_RECORD.match(line):
            return line
        if self.held or _PREFIX.sub("", line).startswith("Traceback (most recent call last)"):
            self.held.append(line)
            return None
        return line

    def last_words(self) -> str:
        """The held traceback's exception line ('RuntimeError: …'), without the rank prefix."""
        lines = [_PREFIX.sub("", ln).strip() for ln in self.held if _PREFIX.sub("", ln).strip()]
        return _SOURCE.sub("", lines[-1]) if lines else ""


def resume_command(argv: list[str], run_dir: Path) -> str:
    """The command line that continues this job in its run directory from its newest checkpoint."""
    dropped = ("checkpoint.resume=", "run.dir=", "run.overwrite=", "fault.", "+fault.")  # a test hook
    kept = [a for a in argv if not a.startswith(dropped)]
    return shlex.join(["fleetwise", "train", *kept, f"run.dir={run_dir}", "checkpoint.resume=auto"])


def _last_checkpoint_step(run_dir: Path) -> tuple[int, Path] | None:
    from fleetwise.runtime.checkpoint_files import META, complete_checkpoints

    done = complete_checkpoints(run_dir)
    if not done:
        return None
    try:
        step = int(json.loads((done[-1] / META).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        step = int(done[-1].name.rsplit("_", 1)[-1])
    return step, done[-1]


def failure_report(
    cfg: RunConfig, run_dir: Path, argv: list[str], error: str, fold: TracebackFold
) -> list[str]:
    """Lines (rich markup) for a failed job: the cause, rank 0's echo in one line, how to resume."""
    from rich.markup import escape

    cause_rank = re.match(r"rank (\d+)", error)
    lines = [f"[bold red]✗ training failed[/]: {escape(error)}"]
    if cause_rank is not None:
        log = rundir.rank_log(run_dir, int(cause_rank.group(1))).relative_to(run_dir)
        lines[0] += f" [dim](its log: {log})[/]"
    if fold.held:
        rank0_log = rundir.rank_log(run_dir, 0)
        if cause_rank is not None and cause_rank.group(1) == "0":
            lines += [escape(ln) for ln in fold.held]
        else:
            words = fold.last_words()
            words = words if len(words) <= 160 else words[:157] + "…"
            lines.append(
                f"  rank 0 stopped as a consequence: {escape(words)} [dim](traceback in {rank0_log})[/]"
            )
    if cfg.strategy.name == "ps":
        return lines
    last = _last_checkpoint_step(run_dir) if cfg.checkpoint.enabled else None
    if last is not None:
        step, path = last
        lines.append(
            f"  resume from step {step} ({path.relative_to(run_dir)}): "
            f"{escape(resume_command(argv, run_dir))}"
        )
    elif cfg.checkpoint.enabled:
        lines.append(
            "  no checkpoint was written before the failure: rerun the job (or lower checkpoint.interval)"
        )
    else:
        lines.append(
            "  no checkpoint to resume from: checkpoint.enabled=true checkpoint.interval=N makes a failed job "
            "resumable (checkpoint.resume=auto)"
        )
    return lines


# Failures that only echo another rank's death (its peers lose the connection or time out).
SYMPTOMS = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting", "connectFullMesh")


def root_cause(run_dir: Path, returncode: int) -> str:
    """The first failure of the job: the rank and its exception message (from the error file
    @record wrote), or its exit code / signal when it died without one (os._exit, SIGKILL, OOM
    killer). torchrun's "first observed failure" can be a peer's connection error observed before
    the dead rank was reaped, so failures are ranked by _blame_order."""
    log = rundir.launcher_log(run_dir)
    failures = _torchrun_failures(log)
    if not failures:  # torchrun itself failed (bad arguments, rendezvous): its last words
        try:
            lines = log.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        last = lines[-1].strip() if lines else ""
        return f"torchrun exited with code {returncode}: {last} (see {log})"
    described = []
    for rank, code, error_file in failures:
        message = _error_file_message(Path(error_file)) if error_file and error_file != "<N/A>" else None
        described.append((rank, code, message))
    rank, code, message = min(described, key=_blame_order)  # min is stable: ties keep torchrun's order
    if message:
        return f"rank {rank} failed: {message}"
    if code.lstrip("-").isdigit() and int(code) < 0:
        try:
            name = signal.Signals(-int(code)).name
        except ValueError:
            name = f"signal {-int(code)}"
        return f"rank {rank} was killed by {name}"
    log_name = rundir.rank_log(run_dir, rank).relative_to(run_dir)
    return f"rank {rank} died with exit code {code} (no Python exception: see {log_name})"


def _blame_order(failure: tuple[str, str, str | None]) -> int:
    """How likely a failure is the cause rather than a consequence: a real exception first, then a
    rank that died without one (os._exit, SIGKILL), then a peer's connection error or collective
    timeout, and last a rank torchrun itself stopped with SIGTERM while tearing the group down
    (a hung rank ends that way; its peer's timeout says more)."""
    _, code, message = failure
    if message:
        return 2 if any(x in message for x in SYMPTOMS) else 0
    return 3 if code == f"-{signal.SIGTERM.value}" else 1


def _torchrun_failures(launcher_log: Path) -> list[tuple[str, str, str]]:
    """(rank, exitcode, error_file) of every failure in torchrun's last report, root cause first."""
    try:
        text = launcher_log.read_text(errors="replace")
    except OSError:
        return []
    marker = text.rfind("Root Cause (first observed failure)")
    if marker < 0:
        return []
    start = text.rfind("Failures:", 0, marker)
    sections = [text[marker:], text[start:marker] if start >= 0 else ""]
    out = []
    for section in sections:
        entry: dict[str, str] = {}
        for line in section.splitlines()[1:] + ["[end]:"]:
            if line.startswith("[") and line.rstrip().endswith("]:"):
                if "rank" in entry:
                    out.append(
                        (
                            entry["rank"].split()[0],
                            entry.get("exitcode", "?").split()[0],
                            entry.get("error_file", ""),
                        )
                    )
                entry = {}
                continue
            key, sep, value = line.strip().partition(":")
            if sep and key.strip() in ("rank", "exitcode", "error_file"):
                entry.setdefault(key.strip(), value.strip())
    return out


def _error_file_message(path: Path) -> str | None:
    try:
        info = json.loads(path.read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    msg = (info.get("message") if isinstance(info, dict) else str(info)) or ""
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else None
