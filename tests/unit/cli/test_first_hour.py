"""A newcomer's first hour: a short smoke run of a real recipe needs no extra override."""

import re

import pytest
from helpers.cli import run_cli
from helpers.config import compose

from fleetwise.plan import make_plan


def test_a_warmup_longer_than_the_run_warms_up_partially_and_says_so():
    cfg, problems = compose("recipe=gpt/tiny", "train.steps=4", "optim.warmup_steps=100")
    assert problems == []
    note = next(n for n in make_plan(cfg).notes if "warmup_steps" in n)
    assert "only reaches 4/100 of optim.lr" in note
    torch = pytest.importorskip("torch")
    del torch
    from fleetwise.runtime.optim import lr_factor

    # the schedule the trainer uses: a linear ramp that the run stops on at 4/100
    assert [lr_factor(d, cfg.optim, cfg.train) for d in range(4)] == pytest.approx([0.01, 0.02, 0.03, 0.04])


def test_plan_prints_the_warmup_note():
    out = run_cli("plan", "recipe=gpt/tiny", "train.steps=4", "optim.warmup_steps=100")
    assert out.returncode == 0, out.stderr
    assert "warm-up is cut short" in out.stdout


def test_user_tags_are_accepted_and_bad_ones_are_named():
    cfg, problems = compose("recipe=gpt/tiny", "+tracking.tags.team=nlp", "+tracking.tags.run=7")
    assert problems == [] and cfg.tracking.tags == {"team": "nlp", "run": "7"}
    _, problems = compose("recipe=gpt/tiny", "+tracking.tags.fleetwise.strategy=x", "+train.foo=1")
    by_loc = {p.loc: p for p in problems}
    assert set(by_loc) == {"tracking.tags.fleetwise", "train.foo"}
    assert "adds keys only under tracking.tags" in by_loc["train.foo"].hint
    _, problems = compose("recipe=gpt/tiny", "+tracking.tags.a$b=1")
    assert [p.loc for p in problems] == ["tracking.tags.a$b"]
    from fleetwise.config.rules import limits

    reserved = cfg.model_copy(
        update={"tracking": cfg.tracking.model_copy(update={"tags": {"mlflow.user": "x"}})}
    )
    assert [p.loc for p in limits.problems(reserved)] == ["tracking.tags.mlflow.user"]


def _plan_json(capsys, *overrides: str) -> dict:
    import json

    from fleetwise import cli

    capsys.readouterr()
    assert cli.main(["plan", *overrides, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_memory_breakdown_adds_up_to_the_total_at_its_peak(capsys):
    """GPT-3 13B under plain DDP peaks outside the backward: at the second step's bucket rebuild (the
    gradients twice, a hair above the optimizer step's AdamW temporaries, one per parameter, which
    the plan still reports): the parts shown are the ones live then, and they add up to the total."""
    plan = _plan_json(capsys, "recipe=gpt/gpt3_13b", "strategy=dp", "hardware=a100")
    mem, peak = plan["memory_bytes"], plan["memory_peak"]
    assert {"params", "grads", "optimizer", "activations", "total", "step_temporaries"} <= set(mem)
    assert peak["phase"] == "DDP bucket rebuild"
    assert sum(peak["parts"].values()) == pytest.approx(mem["total"], abs=8)
    assert peak["parts"]["grads"] == 2 * mem["grads"] == pytest.approx(8 * plan["params"], rel=1e-6)
    assert mem["step_temporaries"] == pytest.approx(4 * plan["params"], rel=1e-6)
    # in backward the activations are live instead, and that sum is smaller
    backward = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"] + mem["inputs"]
    assert backward < mem["total"]
    from fleetwise import cli

    assert cli.main(["plan", "recipe=gpt/gpt3_13b", "strategy=dp", "hardware=a100"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(peak: DDP bucket rebuild)" in out
    for tiny in (["recipe=gpt/tiny"], ["recipe=ctr/tiny", "strategy=ps"], ["recipe=gpt/tiny", "strategy=pp"]):
        plan = _plan_json(capsys, *tiny)
        assert sum(plan["memory_peak"]["parts"].values()) == pytest.approx(
            plan["memory_bytes"]["total"], abs=8
        )


REMEDY_CASES = [
    # peak in the optimizer step: recompute saves nothing; ZeRO does
    ["recipe=gpt/gpt3_13b", "strategy=dp", "hardware=a100"],
    # activations dominate: smaller micro-batches, alone or with another move
    ["recipe=gpt/gpt3_1.3b", "hardware=a100", "strategy=dp", "train.micro_batch_size=32", "hardware.nodes=2"],
    # the recipe's own hybrid layout, pipeline without recompute
    ["recipe=gpt/gpt3_175b", "strategy.pp_degree=4", "strategy.recompute=none"],
]


@pytest.mark.parametrize("overrides", REMEDY_CASES, ids=["13b-dp", "1.3b-mb32", "175b-pp4"])
def test_every_remedy_is_valid_helps_and_plans_as_promised(capsys, overrides):
    """Each printed remedy, added to the command line, validates and plans to the memory it names;
    each saves at least 5% of the memory; fitting ones come first, fastest planned step first."""
    plan = _plan_json(capsys, *overrides)
    assert plan["fits"] is False
    remedies = plan["remedies"]
    assert remedies and remedies[0]["fits"]
    fitting = [r for r in remedies if r["fits"]]
    assert remedies[: len(fitting)] == fitting
    assert [r["step_time_s"] for r in fitting] == sorted(r["step_time_s"] for r in fitting)
    for r in remedies:
        assert r["total_bytes"] <= 0.95 * plan["memory_bytes"]["total"], r
        fixed = _plan_json(capsys, *overrides, *r["overrides"].split())
        assert fixed["memory_bytes"]["total"] == r["total_bytes"] and fixed["fits"] == r["fits"], r


def test_remedies_include_smaller_micro_batches_and_combinations_and_no_no_ops(capsys):
    # the expected texts are derived by planning each move alone here, not pasted from the output
    base = _plan_json(capsys, *REMEDY_CASES[0])["memory_bytes"]["total"]
    full = _plan_json(capsys, *REMEDY_CASES[0], "strategy.recompute=full")["memory_bytes"]["total"]
    assert full > 0.95 * base  # recompute saves under 5% (268.6 of 269 GiB): a no-op, not offered
    texts = [r["overrides"] for r in _plan_json(capsys, *REMEDY_CASES[1])["remedies"]]
    assert not any("recompute" in t for t in _remedy_texts(capsys, REMEDY_CASES[0]))
    fits = {
        mb: _plan_json(capsys, *REMEDY_CASES[1], f"train.micro_batch_size={mb}")["fits"] for mb in (16, 8, 4)
    }
    largest = max(mb for mb, ok in fits.items() if ok)  # 8 when written
    assert f"train.micro_batch_size={largest}" in texts  # the largest micro-batch that fits alone
    smaller = [mb for mb in fits if mb < largest]
    assert smaller and not any(t.endswith(f"train.micro_batch_size={mb}") for mb in smaller for t in texts)
    too_big = [mb for mb, ok in fits.items() if not ok]  # 16 alone does not fit
    assert too_big and [t for t in texts if f"train.micro_batch_size={min(too_big)}" in t and "strategy" in t]


def _remedy_texts(capsys, overrides) -> list[str]:
    return [r["overrides"] for r in _plan_json(capsys, *overrides)["remedies"]]


def test_validate_lists_the_memory_problem_beside_the_others(capsys):
    """gpt2_small on the cpu profile has two problems: bf16 (the recipe's) and memory. Both are listed
    at once, the memory one planned as given; with precision fixed only memory is left."""
    import json

    from fleetwise import cli

    capsys.readouterr()
    assert cli.main(["validate", "recipe=gpt/gpt2_small", "hardware=cpu", "--json"]) == 2
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert [e["loc"] for e in errors] == ["train.precision", "hardware.memory_per_device_gib"]
    assert "planned as given, train.precision unchanged" in errors[1]["msg"]
    assert "cheapest remedies: strategy=" in errors[1]["hint"]
    # a structural problem (the layout is unknown) leaves memory unplanned rather than guessed
    assert (
        cli.main(["validate", "recipe=gpt/gpt2_small", "hardware=cpu", "strategy.dp_degree=3", "--json"]) == 2
    )
    locs = [e["loc"] for e in json.loads(capsys.readouterr().out)["errors"]]
    assert "hardware.memory_per_device_gib" not in locs and "train.precision" in locs
    assert (
        cli.main(["validate", "recipe=gpt/gpt2_small", "hardware=cpu", "train.precision=fp32", "--json"]) == 2
    )
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert [e["loc"] for e in errors] == ["hardware.memory_per_device_gib"]


def test_planned_and_assumed_figures_are_labelled(capsys):
    from fleetwise import cli

    capsys.readouterr()
    assert cli.main(["plan", "recipe=gpt/gpt3_1.3b"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"MFU \d+\.\d% \(planned\)", out) and " planned = compute " in out
    assert "follow the a100 profile's assumed GEMM efficiency curve" in out
    assert cli.main(["plan", "recipe=gpt/tiny"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(planned)" in out and "assumed" not in out  # the cpu profile holds measured costs


def test_plan_and_validate_take_a_sweep(capsys):
    """`plan -m` / `validate -m`: one row per point (`--json`: a list), the same plan as the point alone."""
    import json

    from fleetwise import cli

    capsys.readouterr()
    assert cli.main(["plan", "-m", "recipe=gpt/tiny", "strategy=dp,sharding,pp", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)
    assert [p["overrides"] for p in points] == [
        ["recipe=gpt/tiny", f"strategy={s}"] for s in ("dp", "sharding", "pp")
    ]
    for p in points:
        assert p == {"overrides": p["overrides"], **_plan_json(capsys, *p["overrides"])}
    assert [p["mesh"]["sharding"] for p in points] == [1, 8, 1] and points[2]["mesh"]["pp"] > 1
    assert cli.main(["plan", "-m", "recipe=gpt/tiny", "strategy=dp,sharding,pp"]) == 0
    rows = [
        line.split()[0]
        for line in capsys.readouterr().out.splitlines()
        if line.strip().startswith("strategy=")
    ]
    assert rows == ["strategy=dp", "strategy=sharding", "strategy=pp"]
    # one invalid point: exit 2, the point and its problem named, the valid one still planned
    code = cli.main(
        ["validate", "--multirun", "recipe=gpt/gpt3_13b", "hardware=a100", "strategy=dp,sharding"]
    )
    captured = capsys.readouterr()
    assert code == 2
    assert "strategy=dp:" in captured.err and "hardware.memory_per_device_gib" in captured.err
    assert "strategy=sharding" in captured.out and "✓" in captured.out
    assert cli.main(["validate", "-m", "recipe=gpt/tiny", "strategy=dp,sharding", "--json"]) == 0
    assert [p["valid"] for p in json.loads(capsys.readouterr().out)] == [True, True]


DEMO = [
    "recipe=gpt/tiny",
    "data=bundled",
    "strategy=hybrid",
    "strategy.pp_degree=2",
    "strategy.sharding_degree=2",
    "strategy.sharding_stage=2",
    "strategy.mp_degree=2",
    "train.steps=30",
]


def test_the_demo_on_a_calibrated_two_core_profile_says_which_device_count_it_needs(tmp_path, monkeypatch):
    """`fleetwise calibrate` on 2 cores writes devices_per_node: 2; the 8-rank demo with
    hardware=local then names the exact override, which makes it valid."""
    from helpers.calibration import MEASURED

    from fleetwise.calibrate.calibration import Calibration
    from fleetwise.calibrate.profile import profile_yaml

    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "local.yaml").write_text(profile_yaml(Calibration(**MEASURED)))
    monkeypatch.setenv("FLEETWISE_CONFIG_DIR", str(tmp_path))
    _, problems = compose(*DEMO, "hardware=local")
    (p,) = problems
    assert "hardware.devices_per_node=8 with hardware.nodes=1" in p.hint
    assert compose(*DEMO, "hardware=local", "hardware.devices_per_node=8")[1] == []


def test_a_traceback_is_folded_unless_rank_0_is_the_cause(tmp_path):
    from fleetwise.launcher.failure import TracebackFold, failure_report

    cfg, _ = compose("recipe=gpt/tiny")
    log = [
        "2026-11-24 05:00:00,000 rank0 step 1/4 | loss 5.5",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "trainer.py", line 190, in _all_finite',
        "[rank0]: RuntimeError: [/__w/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2730.",
        "2026-11-24 05:00:01,000 rank0 a log record after it is still shown",
        "05:00:02.000 [trainer0] and a parameter server role's",
    ]
    fold = TracebackFold()
    shown = [line for line in log if fold.feed(line) is not None]
    assert shown == [log[0], log[4], log[5]] and fold.held == log[1:4]
    lines = failure_report(cfg, tmp_path, ["recipe=gpt/tiny"], "rank 1 failed: ValueError: bad", fold)
    assert lines[1].startswith("  rank 0 stopped as a consequence: RuntimeError: Connection closed by peer")
    assert "checkpoint.enabled=true checkpoint.interval=N" in lines[-1]  # nothing to resume from
    lines = failure_report(cfg, tmp_path, ["recipe=gpt/tiny"], "rank 0 failed: RuntimeError: boom", fold)
    from rich.markup import escape

    assert lines[1:4] == [escape(line) for line in log[1:4]]  # its own traceback, whole


def test_fleetwise_tokenize_writes_a_token_file_the_job_accepts(tmp_path, capsys):
    """The README's tokenizer is a command of the installed package (the wheel carries it)."""
    import numpy as np

    from fleetwise import cli

    text = tmp_path / "a.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out = tmp_path / "data" / "a.bin"
    assert cli.main(["tokenize", str(text), "--out", str(out)]) == 0
    tokens = np.fromfile(out, dtype="<u2")
    assert tokens.tolist() == list(text.read_bytes())
    assert compose("recipe=gpt/tiny", "data=token_file", f"data.path={out}", "model.vocab_size=257")[1] == []
    assert cli.main(["tokenize", str(tmp_path / "missing.txt"), "--out", str(out)]) == 2


def test_the_readme_demo_block_is_rewritten_in_place():
    """scripts/readme_demo.py (make readme-demo) replaces only the marked block and its date line."""
    import importlib.util

    from helpers.repo import REPO

    spec = importlib.util.spec_from_file_location("readme_demo", REPO / "scripts" / "readme_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    readme = (REPO / "README.md").read_text()
    assert readme.count(mod.BEGIN) == 1 and readme.count(mod.END) == 1
    new = mod.rewrite(
        readme, "summary (1 steps)\nMLflow run abcdef12…", "(`make demo` on a test box, 2000-01-01):"
    )
    assert f"(`make demo` on a test box, 2000-01-01):\n\n{mod.BEGIN}\n```\nsummary (1 steps)\n" in new
    head, tail = readme.split(mod.BEGIN)[0], readme.split(mod.END)[1]
    assert new.endswith(tail) and mod.STAMP.sub("", new.split(mod.BEGIN)[0]) == mod.STAMP.sub("", head)


def test_the_compare_chart_has_one_throughput_unit_readable_memory_and_loss_curves(tmp_path):
    import struct

    from fleetwise.tracking.compare import RunRow, chart_data, write_chart

    def row(name, unit, rate, samples, curve):
        return RunRow(
            run_id=name * 8,
            name=name,
            strategy="dp",
            world_size="2",
            status="FINISHED",
            throughput=rate,
            unit=unit,
            mfu=0.01,
            peak_bytes=1.65 * 2**20,
            predicted_bytes=1.68 * 2**20,
            final_loss=3.3,
            samples_per_s=samples,
            loss_curve=curve,
        )

    rows = [
        row("a", "tokens/s", 453.0, 14.2, [(1, 5.5), (2, 4.0)]),  # a token model
        row("b", "samples/s", 2562.0, 2562.0, [(1, 0.7), (2, 0.4)]),  # the CTR model
    ]
    data = chart_data(rows)
    assert data["rates"] == [14.2, 2562.0] and data["rate_label"] == "mean throughput (samples/s)"
    assert data["memory_label"] == "peak memory per device (MiB)"
    assert data["peak"] == pytest.approx([1.65, 1.65]) and data["predicted"] == pytest.approx([1.68, 1.68])
    assert data["loss"] == {rows[0].label: [(1, 5.5), (2, 4.0)], rows[1].label: [(1, 0.7), (2, 0.4)]}
    png = write_chart(rows, tmp_path / "c.png").read_bytes()
    width = struct.unpack(">I", png[16:20])[0]
    assert width >= 3 * 6.5 * 110 - 2  # three panels: throughput, memory, loss
