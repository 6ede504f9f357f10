"""`python -m fleetwise.runtime.ps RUN_DIR`: one process of a parameter-server job under torchrun.

Loads RUN_DIR/config.yaml (a resolved RunConfig), sends this process's output to
RUN_DIR/logs/rank_<RANK>.log and calls `fleetwise.runtime.ps.run`. Example (2 trainers + 2 servers):

    python -m torch.distributed.run --nproc-per-node 4 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:0 -m fleetwise.runtime.ps RUN_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from fleetwise.config.run import RunConfig
from fleetwise.runtime.ps import run


def redirect_output(run_dir: Path, rank: str) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(logs / f"rank_{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)  # file descriptors, so C++ (TensorPipe, gloo) output lands there too
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fleetwise.runtime.ps RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    redirect_output(run_dir, os.environ.get("RANK", "0"))
    cfg = RunConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    run(cfg, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
