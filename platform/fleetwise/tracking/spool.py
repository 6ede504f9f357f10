"""metrics.jsonl is the durable spool between rank 0 and MLflow; tracking.json is its cursor.

Rank 0 appends one JSON object per optimizer step (`step`, optionally `time` in Unix seconds, and
metric names). The launcher ships complete lines to MLflow and, after every accepted batch,
records in tracking.json how far it got (byte offset and line count). A dead server, a crashed
launcher or a restarted job therefore neither loses nor repeats a step: the next poll, or
`fleetwise sync`, carries on from the cursor. Nothing here imports mlflow.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import numbers
import os
import socket
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fleetwise.rundir import METRICS_FILE, RECORD_KEYS, TRACKING_FILE

LOCK_FILE = ".tracking.lock"
# The launcher stamps tracking.json this often while its job runs (RunTracker.heartbeat), so that a
# later command can tell a launcher that died without a word (kill -9, the OOM killer, a lost node)
# and say when it was last seen.
HEARTBEAT_EVERY_S = 10.0
# A launcher on another host is taken for gone after this long without a heartbeat (its pid means
# nothing here); a launcher on this host is gone when its pid is.
STALE_AFTER_S = 120.0
READ_CHUNK = 1 << 20  # bytes read per pass: a long backlog is shipped in slices, not slurped


@dataclass
class TrackingState:
    """Contents of <run_dir>/tracking.json."""

    tracking_uri: str
    experiment: str
    run_name: str
    run_id: str | None = None
    parent_run_id: str | None = None
    start_time_ms: int = 0
    delivered_lines: int = 0  # lines of metrics.jsonl consumed (shipped or skipped as malformed)
    delivered_offset: int = 0  # byte offset just past the last consumed line
    skipped_lines: int = 0  # malformed lines, or lines MLflow rejected
    rerun_lines: int = 0  # steps re-run after a resume, already in MLflow: not logged twice
    last_step: int = 0
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    setup_done: bool = False  # params and tags are on the run
    pending_artifacts: list[str] = field(default_factory=list)
    final: dict | None = None  # set by finish(): status, error, summary, end_time_ms
    closed: bool = False  # the final status reached MLflow
    launcher_host: str = ""  # who owns the run while it runs (the `fleetwise train` on node 0)
    launcher_pid: int = 0
    heartbeat_ms: int = 0  # when that launcher was last seen alive (Unix ms)
    version: int = 1

    @classmethod
    def from_dict(cls, data: dict) -> TrackingState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def load_state(run_dir: Path) -> TrackingState | None:
    path = Path(run_dir) / TRACKING_FILE
    try:
        return TrackingState.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def save_state(run_dir: Path, state: TrackingState) -> None:
    # Write-then-rename: a crash mid-write leaves the previous cursor, never a torn file.
    path = Path(run_dir) / TRACKING_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    os.replace(tmp, path)


def read_lines(path: Path, offset: int, *, final: bool = False) -> list[tuple[int, bytes]]:
    """Complete lines of `path` from byte `offset` (at most ~READ_CHUNK bytes' worth).

    Returns (end offset of the line, line) pairs. A trailing line without its newline is still
    being written, so it is left for later, unless `final` (the writer is gone): then it is
    returned too, to be shipped if it parses and skipped if it was torn by a crash.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(READ_CHUNK)
            at_eof = len(data) < READ_CHUNK
            if not at_eof and b"\n" not in data:
                data += f.read()  # one enormous line: take it whole
                at_eof = True
    except FileNotFoundError:
        return []
    end = len(data) if final and at_eof else data.rfind(b"\n") + 1
    out, start = [], 0
    while start < end:
        stop = data.find(b"\n", start, end) + 1 or end
        out.append((offset + stop, data[start:stop]))
        start = stop
    return out


def parse_record(line: bytes) -> dict | None:
    """The JSON object of one line, or None when the line is not one."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def metric_values(record: dict) -> dict[str, float]:
    """The numeric entries of a record, as floats (booleans and strings are not metrics)."""
    return {k: float(v) for k, v in record.items() if k not in RECORD_KEYS and number(v)}


def read_records(run_dir: Path) -> list[dict]:
    """Every well-formed record of <run_dir>/metrics.jsonl (e.g. for `summarize`)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    with open(path, "rb") as f:
        return [r for r in map(parse_record, f) if r is not None]


def is_behind(run_dir: Path) -> bool:
    """Whether MLflow is missing something of this run dir that `fleetwise sync` could deliver."""
    state = load_state(run_dir)
    if state is None:
        return False
    try:
        size = (Path(run_dir) / METRICS_FILE).stat().st_size
    except FileNotFoundError:
        size = 0
    return (
        state.run_id is None
        or not state.setup_done
        or state.delivered_offset < size
        or bool(state.pending_artifacts)
        or (state.final is not None and not state.closed)
    )


def launcher_gone(state: TrackingState, now_ms: int | None = None) -> bool:
    """Whether the launcher that owns this unfinished run died without ending it: its pid is gone
    (this host) or its heartbeat is STALE_AFTER_S old (another host). A state written before
    heartbeats existed, or one already ended, is never taken for gone. The caller also takes the
    run dir's lock (RunDirLock), which a live launcher holds."""
    if state.final is not None or state.closed or state.launcher_pid <= 0:
        return False
    if state.launcher_host == socket.gethostname():
        return not pid_alive(state.launcher_pid)
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return now_ms - state.heartbeat_ms > STALE_AFTER_S * 1000


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def number(value: object) -> bool:
    """A real number (numpy scalars included), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite(value: object) -> bool:
    return number(value) and math.isfinite(value)


class RunDirLock:
    """An exclusive flock on <run_dir>/.tracking.lock, so that the launcher that owns a run and a
    `fleetwise sync` of the same dir never ship the same lines twice. The kernel drops it when
    the holder dies, so a crashed launcher never leaves a stale lock behind."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> bool:
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
