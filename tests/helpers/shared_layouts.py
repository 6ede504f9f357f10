"""Layouts that more than one test file runs (kept once, so that they cannot drift apart)."""

# ZeRO-2 × mp 2 in bf16 with a vocabulary that dominates (gpt/tiny, 4 ranks): the peak is FSDP's
# reduce-scatter of the root's fp32 gradients, where gloo reduces a copy of the whole input.
# test_dryrun.py holds the dry run to a real run on it, test_planner_vs_dryrun.py the planner to
# the dry run.
SH2_MP2_BF16_VOCAB16K = (
    "strategy=hybrid",
    "strategy.sharding_degree=2",
    "strategy.sharding_stage=2",
    "strategy.mp_degree=2",
    "strategy.dp_degree=1",
    "train.precision=bf16",
    "hardware.has_bf16=true",
    "model.vocab_size=16384",
)
