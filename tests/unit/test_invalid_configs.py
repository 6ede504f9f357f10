"""A corpus of invalid configs: each is rejected with the right location, a message and a fix.

Table-driven so that it keeps growing with every new rule (target: >= 80 cases).
"""

import pytest

HYB = ("strategy=hybrid",)
PP2 = ("strategy=hybrid", "strategy.pp_degree=2")

CASES = [
    # --- degrees and world size
    (("strategy.dp_degree=3",), "strategy"),
    (("strategy=sharding", "strategy.sharding_degree=3"), "strategy"),
    (("strategy=hybrid", "strategy.mp_degree=auto", "strategy.pp_degree=auto"), "strategy"),
    (("strategy=hybrid", "strategy.mp_degree=3"), "strategy.dp_degree"),
    (("strategy=hybrid", "strategy.dp_degree=2", "strategy.mp_degree=2", "strategy.pp_degree=4"), "strategy"),
    (("strategy=dp", "strategy.mp_degree=2"), "strategy.mp_degree"),
    (
        ("strategy=mp", "strategy.pp_degree=2", "strategy.mp_degree=2", "strategy.dp_degree=2"),
        "strategy.pp_degree",
    ),
    (("strategy=pp", "strategy.sharding_degree=2"), "strategy.sharding_degree"),
    (("strategy.dp_degree=0",), "strategy.dp_degree"),
    (("strategy.dp_degree=x",), "strategy.dp_degree"),
    (("hardware.devices_per_node=0",), "hardware.devices_per_node"),
    (("hardware.nodes=0",), "hardware.nodes"),
    # --- tensor parallel
    (("strategy=mp",), "strategy.mp_degree"),  # mp=8 does not divide 4 heads
    (
        (
            "strategy=mp",
            "strategy.mp_degree=4",
            "strategy.dp_degree=2",
            "model.ffn_hidden_size=258",
            "model.hidden_size=64",
        ),
        "strategy.mp_degree",
    ),
    (("recipe=resnet/tiny", "strategy=hybrid", "strategy.mp_degree=2"), "strategy.mp_degree"),
    (("recipe=ctr/tiny", "strategy=hybrid", "strategy.mp_degree=2"), "strategy.mp_degree"),
    (("strategy=hybrid", "strategy.sequence_parallel=true"), "strategy.sequence_parallel"),
    (
        ("strategy=hybrid", "strategy.mp_degree=2", "strategy.sequence_parallel=true", "model.seq_len=33"),
        "strategy.sequence_parallel",
    ),
    (("model.hidden_size=66",), "model.hidden_size"),
    (("model.vocab_size=1",), "model.vocab_size"),
    (("model.num_attention_heads=0",), "model.num_attention_heads"),
    (("model.dropout=1.5",), "model.dropout"),
    # --- pipeline
    (("strategy=pp", "strategy.pp_degree=8"), "strategy.pp_degree"),
    (
        ("recipe=ctr/tiny", "strategy=pp", "strategy.pp_degree=2", "strategy.dp_degree=4"),
        "strategy.pp_degree",
    ),
    ((*PP2, "strategy.virtual_stages=2", "strategy.schedule=1F1B"), "strategy.schedule"),
    ((*PP2, "strategy.schedule=interleaved_1F1B"), "strategy.virtual_stages"),
    ((*PP2, "strategy.schedule=looped_BFS"), "strategy.virtual_stages"),
    (
        (
            "strategy=hybrid",
            "strategy.pp_degree=4",
            "strategy.virtual_stages=2",
            "strategy.schedule=interleaved_1F1B",
            "strategy.dp_degree=2",
        ),
        "strategy.pp_degree",
    ),
    ((*PP2, "model.num_layers=3"), "strategy.pp_degree"),
    ((*PP2, "strategy.layer_split=[1,2]"), "strategy.layer_split"),
    ((*PP2, "strategy.layer_split=[4]"), "strategy.layer_split"),
    (("strategy.layer_split=[2,2]",), "strategy.layer_split"),
    (("strategy.layer_split=[0,4]", *PP2), "strategy.layer_split.0"),
    (
        (
            *PP2,
            "strategy.virtual_stages=2",
            "strategy.schedule=interleaved_1F1B",
            "train.global_batch_size=24",
        ),
        "train.accumulate_steps",
    ),
    (("strategy=hybrid", "strategy.pp_degree=4", "train.global_batch_size=8"), "train.accumulate_steps"),
    (("strategy.virtual_stages=2",), "strategy.virtual_stages"),
    (
        (
            *PP2,
            "model.num_layers=6",
            "strategy.virtual_stages=3",
            "strategy.schedule=ZBV_zero_bubble",
            "train.global_batch_size=32",
        ),
        "strategy.virtual_stages",
    ),
    ((*PP2, "strategy.schedule=2F2B"), "strategy.schedule"),
    (("strategy.virtual_stages=0",), "strategy.virtual_stages"),
    # --- sharding, offload, recompute
    ((*HYB, "strategy.sharding_stage=2"), "strategy.sharding_stage"),
    ((*HYB, "strategy.sharding_degree=2"), "strategy.sharding_stage"),
    (("strategy=sharding", "strategy.sharding_stage=null"), "strategy.sharding_stage"),
    (("strategy=sharding", "strategy.sharding_stage=4"), "strategy.sharding_stage"),
    (("strategy.offload=true",), "strategy.offload"),
    (("strategy=sharding", "strategy.sharding_stage=1", "strategy.offload=true"), "strategy.offload"),
    (
        (*HYB, "strategy.sharding_degree=2", "strategy.sharding_stage=1", "strategy.mp_degree=2"),
        "strategy.sharding_stage",
    ),
    (("strategy.recompute=some",), "strategy.recompute"),
    (("recipe=ctr/tiny", "strategy=dp", "strategy.recompute=full"), "strategy.recompute"),
    # --- parameter server
    (("strategy=ps",), "strategy.dense_fallback"),
    (("recipe=ctr/tiny", "strategy.max_staleness=2"), "strategy.max_staleness"),
    (("recipe=ctr/tiny", "strategy.num_trainers=3"), "train.global_batch_size"),
    (("recipe=ctr/tiny", "strategy.num_servers=0"), "strategy.num_servers"),
    (("recipe=ctr/tiny", "strategy.mode=eventual"), "strategy.mode"),
    (("recipe=ctr/tiny", "strategy.dispatch=random"), "strategy.dispatch"),
    (
        ("recipe=ctr/tiny", "model.sparse_tables=[{name:a,num_embeddings:5},{name:a,num_embeddings:6}]"),
        "model.sparse_tables",
    ),
    (("recipe=ctr/tiny", "model.sparse_tables=[]"), "model.sparse_tables"),
    # --- model families
    (("recipe=ernie/tiny", "model.mask_prob=0.01"), "model.mask_prob"),
    (("recipe=ernie/tiny", "model.masking=span"), "model.masking"),
    (("recipe=resnet/tiny", "model.image_size=16"), "model.image_size"),
    (("recipe=resnet/tiny", "model.layers=[1,1,1]"), "model.layers"),
    (("recipe=resnet/tiny", "model.block=dense"), "model.block"),
    # --- batch and precision
    (("train.global_batch_size=20",), "train.global_batch_size"),
    (("train.accumulate_steps=2",), "train.accumulate_steps"),
    (("train.micro_batch_size=32",), "train.micro_batch_size"),
    (("train.steps=0",), "train.steps"),
    (("train.precision=bf16",), "train.precision"),
    (("train.precision=fp16",), "train.precision"),
    (("train.precision=fp8",), "train.precision"),
    (("recipe=ernie/ernie_base", "train.precision=bf16"), "train.precision"),
    (("hardware.backend=nccl",), "hardware.backend"),
    (("hardware.backend=mpi",), "hardware.backend"),
    # --- data
    (("data=token_file",), "data.path"),
    (("data=token_file", "data.path=/nonexistent/tokens.bin"), "data.path"),
    (("data=image_array", "data.path=/nonexistent.npz"), "data.source"),
    (("recipe=resnet/tiny", "data=image_folder", "data.path=/nonexistent"), "data.path"),
    (("data.source=csv",), "data.source"),
    # --- optimizer
    (("optim.warmup_steps=100",), "optim.warmup_steps"),
    (("optim.betas=[0.9,1.5]",), "optim.betas"),
    (("optim.name=lion",), "optim.name"),
    (("optim.lr=0",), "optim.lr"),
    # --- launch, faults, checkpoints, tracking
    (("launch.nnodes=2",), "launch.nnodes"),
    (("launch.nnodes=abc",), "launch.nnodes"),
    (("launch.nnodes=2:1",), "launch.nnodes"),
    (("launch.node_rank=3",), "launch.node_rank"),
    (("launch.rdzv_endpoint=nohostport",), "launch.rdzv_endpoint"),
    (("fault.kill_rank=9", "fault.at_step=1"), "fault.kill_rank"),
    (("fault.kill_rank=1",), "fault.at_step"),
    (("fault.kill_rank=0", "fault.at_step=100"), "fault.at_step"),
    (("fault.mode=explode",), "fault.mode"),
    (("checkpoint.interval=5",), "checkpoint.interval"),
    (("checkpoint.resume=/nonexistent/ckpt",), "checkpoint.resume"),
    (("tracking.enabled=maybe",), "tracking.enabled"),
    (("plan.memory_check=maybe",), "plan.memory_check"),
    # --- memory: the plan does not fit
    (
        ("recipe=gpt/gpt3_175b", "strategy.pp_degree=8", "strategy.recompute=none"),
        "hardware.memory_per_device_gib",
    ),
    (("recipe=gpt/gpt3_6.7b", "strategy=dp", "strategy.mp_degree=1"), "hardware.memory_per_device_gib"),
    # --- Hydra-level: unknown keys, groups, options, syntax
    (("train.stepz=3",), "train.stepz"),
    (("+train.foo=1",), "train.foo"),
    (("strategy=foo",), "strategy"),
    (("recipe=gpt/huge",), "recipe"),
    (("strateg=dp",), "strateg"),
    (("train.steps=[1,",), "train.steps"),
]


def _validate(overrides):
    """What `fleetwise validate` reports (config problems + the memory check)."""
    from fleetwise.cli import preflight

    return preflight(list(overrides)).problems


def test_corpus_is_large_and_distinct():
    assert len(CASES) >= 80
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("overrides,loc", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_invalid_config_is_rejected_at_its_location(overrides, loc):
    problems = _validate(overrides)
    assert problems, f"{overrides} was accepted"
    locs = [p.loc for p in problems]
    assert loc in locs, f"expected {loc}, got {problems}"
    for p in problems:
        assert p.msg and p.hint, p


def test_degree_product_error_names_all_four_degrees_and_the_world_size():
    (p,) = _validate(["strategy.dp_degree=3"])
    for word in ("sharding_degree(1)", "dp_degree(3)", "mp_degree(1)", "pp_degree(1)", "world_size(8)"):
        assert word in p.msg
    assert "strategy.dp_degree=8" in p.hint


def test_all_problems_are_reported_together():
    problems = _validate(
        [
            "strategy.dp_degree=3",
            "train.precision=bf16",
            "optim.warmup_steps=999",
            "train.stepz=1",
            "model.hidden_size=66",
        ]
    )
    assert {"strategy", "train.precision", "optim.warmup_steps", "train.stepz", "model.hidden_size"} <= {
        p.loc for p in problems
    }


def test_unknown_key_suggests_the_close_one():
    (p,) = _validate(["strategy.mp_degre=2"])
    assert p.loc == "strategy.mp_degre" and "Did you mean 'mp_degree'" in p.msg
    (p,) = _validate(["recipe=gpt/tinyy"])
    assert "gpt/tiny" in p.msg


def test_memory_problem_lists_numbers_and_remedies_and_can_be_waived():
    problems = _validate(["recipe=gpt/gpt3_175b", "strategy.pp_degree=8", "strategy.recompute=none"])
    (p,) = problems
    assert "GiB" in p.msg and "strategy.recompute=full" in p.hint and "plan.memory_check=warn" in p.hint
    assert (
        _validate(
            [
                "recipe=gpt/gpt3_175b",
                "strategy.pp_degree=8",
                "strategy.recompute=none",
                "plan.memory_check=warn",
            ]
        )
        == []
    )


@pytest.mark.slow  # every case through `fleetwise train` in-process: minutes
@pytest.mark.parametrize("overrides,loc", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_train_refuses_it_with_exit_2_spawning_and_writing_nothing(
    overrides, loc, tmp_path, monkeypatch, capsys
):
    """The same corpus through `fleetwise train`: exit 2, the location named, no process started
    (Popen is forbidden), no run directory, Hydra output, or MLflow store written."""
    import subprocess

    from fleetwise.cli import main

    def forbidden(*args, **kwargs):
        raise AssertionError(f"a process was spawned for an invalid config: {args[:1]}")

    monkeypatch.setattr(subprocess.Popen, "__init__", forbidden)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["train", *overrides, f"run.dir={run_dir}"]) == 2
    assert loc in " ".join(capsys.readouterr().err.split())
    assert list(tmp_path.iterdir()) == []
