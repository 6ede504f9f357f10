"""What the console says when a job fails: the root cause first, the peers' echoes folded.

When one rank dies, its peers fail too, with gloo's "Connection closed by peer" and a long
traceback that says nothing about the cause. Rank 0's log is what the console follows, so those
tracebacks used to scroll past before the one line that matters. `TracebackFold` holds a
traceback back from the console (it stays in logs/rank_N.log); `failure_report` then leads with
the rank that caused the failure, names the held traceback in one line when it is only an echo
(printed whole when rank 0 is the cause), and gives the command that resumes the job from its
last checkpoint.
"""

from __future__ import annotations

import re
import shlex
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
    import json

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
