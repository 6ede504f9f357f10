"""16-bit training on CPU tensors with nothing stubbed: torch's autocast and GradScaler both run on
the CPU (torch >= 2.3), so the trainer's precision logic can be checked for real in this process
(a gloo world of one, the real Trainer under a GPU profile: validation refuses 16 bits on
hardware=cpu). tests/integration/test_cuda_semantics.py runs the same trainer on a stand-in device
where autocast is a no-op and GradScaler's overflow flag always reads 0; this file is what those
stubs leave out: the 16-bit matmuls themselves, and a real overflow skipping a real step.

The references are the test's own: a forward hook reads the dtype the LM head's matmul produced,
the parameters are copied before a step and compared after, and GradScaler's scale follows its
documented rule (start 2^16, halve on an overflow, double after 2000 clean steps)."""

from __future__ import annotations

from helpers.runs import one_rank_trainer


def trainer(tmp_path, precision: str, steps: int):
    return one_rank_trainer(
        tmp_path / precision,
        "recipe=gpt/tiny", "hardware=a100", "hardware.devices_per_node=1", f"train.precision={precision}",
        "train.global_batch_size=4", "train.micro_batch_size=2", f"train.steps={steps}", "train.log_interval=1",
        "optim=sgd", "optim.lr=0.1", "optim.momentum=0.0", "optim.warmup_steps=1",
        "checkpoint.enabled=false", "tracking.enabled=false",
    )  # fmt: skip


def head_dtypes(model) -> list:
    """Record the dtype of every output of the model's LM head (an nn.Linear) from now on."""
    seen = []
    model.output.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    return seen


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(before: dict, model) -> set[str]:
    import torch

    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


def test_fp16_overflow_skips_the_step_halves_the_scale_and_is_counted(gloo_world_of_one, tmp_path):
    import torch

    t = trainer(tmp_path, "fp16", steps=3)
    (model,) = t.model.parts
    dtypes = head_dtypes(model)
    records, updated = [], []
    for step in (1, 2, 3):
        before = snapshot(model)
        hook = None
        if step == 2:  # one infinite gradient element, on the LM head's weight
            hook = model.output.weight.register_hook(
                lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
            )
        records += t.train_step(step)
        if hook is not None:
            hook.remove()
        updated.append(changed(before, model))
    assert set(dtypes) == {torch.float16}  # autocast really ran the head's matmul in fp16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 weights under autocast
    assert [r["train/loss_scale"] for r in records] == [2.0**16, 2.0**15, 2.0**15]
    assert [r["train/skipped_steps"] for r in records] == [0, 1, 1]
    assert updated[1] == set()  # the overflowing step changed no parameter
    everything = {n for n, _ in model.named_parameters()}
    assert updated[0] == updated[2] == everything  # the clean ones changed every parameter
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_autocast_runs_the_matmuls_in_bf16(gloo_world_of_one, tmp_path):
    import torch

    t = trainer(tmp_path, "bf16", steps=1)
    (model,) = t.model.parts
    dtypes = head_dtypes(model)
    (record,) = t.train_step(1)
    assert set(dtypes) == {torch.bfloat16}
    assert t.scaler is None and record["train/skipped_steps"] == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
