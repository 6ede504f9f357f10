"""Which rank the failure summary blames, from torchrun's report (no processes needed)."""

import json

import pytest

from fleetwise.launcher.failure import root_cause


def _report(tmp_path, failures):
    """A launcher.log in torchrun's format; failures[0] is torchrun's "first observed failure"."""

    def block(i, rank, code, message):
        error_file = "<N/A>"
        if message:
            path = tmp_path / f"error_{i}.json"
            path.write_text(json.dumps({"message": {"message": f"Traceback ...\n{message}\n"}}))
            error_file = str(path)
        return [
            f"[{i}]:",
            "  time      : 2026-11-22_10:00:00",
            f"  rank      : {rank} (local_rank: {rank})",
            f"  exitcode  : {code} (pid: 1{rank})",
            f"  error_file: {error_file}",
            "  traceback : ...",
        ]

    lines = ["fleetwise.runtime.worker FAILED", "-" * 20, "Failures:"]
    for i, f in enumerate(failures[1:], 1):
        lines += block(i, *f)
    lines += ["-" * 20, "Root Cause (first observed failure):"] + block(0, *failures[0]) + ["=" * 20]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "launcher.log").write_text("\n".join(lines) + "\n")
    return root_cause(tmp_path, 1)


@pytest.mark.parametrize(
    "failures,expected",
    [
        # a rank that raised is the cause, whatever torchrun saw first
        (
            [(0, 1, "RuntimeError: Connection reset by peer"), (1, 1, "FaultInjected: rank 1 at step 3")],
            "rank 1 failed: FaultInjected: rank 1 at step 3",
        ),
        # a rank that died hard beats its peer's connection error
        (
            [(0, 1, "RuntimeError: [gloo] Connection closed by peer"), (1, -9, None)],
            "rank 1 was killed by SIGKILL",
        ),
        ([(1, 1, "RuntimeError: Connection reset by peer"), (0, 3, None)], "rank 0 died with exit code 3"),
        # a hung rank is SIGTERMed by torchrun: the peer's collective timeout says more
        (
            [(1, -15, None), (0, 1, "RuntimeError: Timed out waiting 5000ms for recv")],
            "rank 0 failed: RuntimeError: Timed out waiting 5000ms for recv",
        ),
        # only SIGTERMs (the user stopped the job): say so
        ([(0, -15, None), (1, -15, None)], "rank 0 was killed by SIGTERM"),
    ],
)
def test_root_cause_blames_the_cause_not_the_symptom(tmp_path, failures, expected):
    assert _report(tmp_path, failures).startswith(expected)


def test_torchrun_failing_before_any_rank_reports_its_last_words(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "launcher.log").write_text("...\nRendezvousTimeoutError: no quorum\n")
    assert "RendezvousTimeoutError: no quorum" in root_cause(tmp_path, 1)
