"""A newcomer's first hour: a short smoke run of a real recipe needs no extra override."""

import pytest
from conftest import compose, run_cli

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
    from fleetwise.config import limits

    reserved = cfg.model_copy(
        update={"tracking": cfg.tracking.model_copy(update={"tags": {"mlflow.user": "x"}})}
    )
    assert [p.loc for p in limits.problems(reserved)] == ["tracking.tags.mlflow.user"]
