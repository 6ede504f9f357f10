"""`make bench`'s hf suite (fleetwise's Llama against transformers' LlamaForCausalLM): it runs
scripts/bench_hf.py in one process and under torchrun on 2 ranks with at least 5 interleaved
repetitions, and prints the median tokens/s ratio against the 1.0 target. The script itself is run
by hand (README); here its output is stood in for."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from helpers.repo import REPO

sys.path.insert(0, str(REPO / "scripts"))  # bench.py imports its sibling bench_slices
spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_hf_suite_runs_one_and_two_ranks_and_prints_the_median_ratio(tmp_path):
    commands = []

    def sh(cmd, env=None):
        commands.append(cmd)
        ranks = 2 if "torch.distributed.run" in cmd else 1
        reps = int(cmd[cmd.index("--reps") + 1])
        Path(cmd[cmd.index("--reps") - 1]).write_text(json.dumps({
            "ranks": ranks, "reps": reps, "steps": 4, "load_average": 0.5,
            "model": {"num_hidden_layers": 4, "hidden_size": 512, "batch": 4, "seq_len": 256, "vocab_size": 8192},
            "first_loss": {"fleetwise": 9.1, "transformers": 9.1},
            "tokens_per_s": {"fleetwise": 1100.0, "transformers": 1000.0},
            "ratio_median": 1.1 if ranks == 1 else 0.9, "ratio_min": 0.85, "ratio_max": 1.2,
        }))  # fmt: skip

    fake = SimpleNamespace(quick=False, reps=3, tmp=tmp_path, env={}, sh=sh)
    result = bench.Bench.hf(fake)
    assert [("torch.distributed.run" in c) for c in commands] == [False, True]
    assert all(c[c.index("--reps") + 1] == "5" for c in commands)  # at least 5, though --reps is 3
    assert [r["met"] for r in result["rows"]] == [True, False]
    text = bench.markdown(
        {"machine": {"cpu": "x", "cores": 2, "torch": "2"}, "total_s": 1, "suites": {"hf": result}}
    )
    assert "1.100 (0.850-1.200)" in text and "0.900 (0.850-1.200)" in text and "2 (FSDP2)" in text
