"""What the tests share that is not a fixture (fixtures and pytest hooks are in tests/conftest.py).

Importable as `helpers` (pytest's `pythonpath = ["tests"]` in pyproject.toml); test files import
from here, never from `conftest` or from each other. A helper shares no code with what the tests
check beyond the public names it calls.

    repo.py              REPO (the repository root) and scripts/ loaded as modules
    config.py            compose: compose + validate a config, returning its problems instead of raising
    cli.py               run_cli: the installed console script in a subprocess
    runs.py              what a finished run left: its metrics lines, its consolidated final weights
    calibration.py       MEASURED: a fixed calibration (a 2-core CPU profile) for the planner-term tests
    shared_layouts.py    layouts that more than one test file runs
    tracking_support.py  a fake training job writing metrics.jsonl, ports, an HTTP helper
    ps_plain_loop.py     sync parameter-server training written without the product's trainer
    cuda_semantics.py    one simulated rank on a device that refuses host tensors in collectives
                         (forked_rank: a process of its own per rank)
"""
