"""The CPU memory metric (`memory/peak_bytes_max`, runtime/memory.py LiveTensorBytes) against an
instrument that shares nothing with it: the kernel's count of this process's resident memory.

The real run, the dry run and the planner are compared with each other elsewhere
(tests/integration/test_dryrun.py, test_planner_vs_dryrun.py), and the first two use this same
tracker: a tracker that missed a class of storages (optimizer state alive before the step, say)
would leave all three agreeing and the "fits" verdict wrong. Here the real Trainer (a gloo world of
one, this process) runs a model whose tensors dominate its memory, and the tracked peak of a step
is held against the resident-set growth of the process from before the model existed to the
highest point of that step (Linux: /proc/self/status VmHWM, reset through /proc/self/clear_refs,
so earlier tests' peaks do not count).

Why the two agree closely, and what the gap is made of:
- every big tensor is over glibc's largest mmap threshold (32 MiB on 64-bit): each is mapped
  fresh, resident once written and returned to the kernel when freed, so the resident set follows
  it page for page; the tensor bytes of this job are ~97% such tensors;
- a warm-up job first imports and starts everything a step needs (modules, threads, allocator
  arenas), so the growth measured is the model's, not the process's start-up;
- what remains: the small tensors (layer norms, the tiny blocks: < 2 MB) may reuse heap pages the
  process already holds (tracked, not grown), and the Python side of a step (autograd nodes,
  metric records) grows without being a tensor (grown, not tracked): measured -0.3% to +1.7% of
  a 419 MB peak. The bound below is 8% either way.
The step's peak is in the loss's backward (256 x 66048 fp32 logits, their log-softmax and its
gradient, 68 MB each) with AdamW's moments alive but not yet touched: a tracker not told of them
(runtime/memory.py state_tensors without the optimizer loop) reports 347 MB, 17% low, and fails
here. (At the optimizer step's own peak it would not: the tracker counts a storage from the first
op that writes it, and AdamW writes its moments there.)
Not covered here: storages of other ranks' collectives (gloo buffers, DDP buckets) -- a world of
one has none -- and GPU memory (there the metric is CUDA's allocator statistics, not this tracker).
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
from helpers.runs import one_rank_trainer

MB = 1e6
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def resident(field: str) -> int:
    """VmRSS (now) or VmHWM (the highest since the last reset) of this process, in bytes."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", STATUS.read_text(), re.M).group(1)) * 1024


def reset_high_water_mark() -> None:
    CLEAR_REFS.write_text("5")  # Linux: VmHWM := VmRSS


def trainer(tmp_path, name: str, vocab: int):
    """gpt/tiny at width 128 with a vocabulary of `vocab`: the embedding and the untied LM head are
    vocab x 128 fp32 each, and the logits of one micro-batch 256 tokens (8 x 32) x vocab fp32."""
    return one_rank_trainer(
        tmp_path / name,
        "recipe=gpt/tiny", "hardware.devices_per_node=1", f"model.vocab_size={vocab}", "model.hidden_size=128",
        "train.global_batch_size=8", "train.micro_batch_size=8", "train.steps=2",
        "checkpoint.enabled=false", "tracking.enabled=false",
    )  # fmt: skip


@pytest.mark.skipif(not CLEAR_REFS.exists(), reason="needs Linux's resettable VmHWM")
def test_tracked_peak_matches_the_resident_growth_of_a_step(gloo_world_of_one, tmp_path):
    import torch

    from fleetwise.runtime.memory import TensorPeak

    warm = trainer(tmp_path, "warm", 256)
    warm.train_step(1)
    del warm
    gc.collect()
    before_model = resident("VmRSS")

    vocab = 66048  # 66048 x 128 x 4 B = 33.8 MB > glibc's 32 MiB mmap threshold
    big = trainer(tmp_path, "big", vocab)
    big.train_step(1)  # creates AdamW's state: step 2 starts with it, as a resumed job's first step
    big.memory = TensorPeak(torch.device("cpu"), samples=1)  # track step 2 only
    gc.collect()
    reset_high_water_mark()
    (record,) = big.train_step(2)
    grown = resident("VmHWM") - before_model
    tracked = record["memory/peak_bytes_max"]

    # the state alive before the step, by the test's own count: the two vocab x 128 weights and
    # their two AdamW moments each, 203 MB (the bound needs tensors to dominate: >= 100 MB)
    big_tensor = vocab * 128 * 4
    assert sum(p.numel() * p.element_size() for p in big.model.parameters()) > 2 * big_tensor
    print(
        f"\nresident growth {grown / MB:.1f} MB, tracked peak {tracked / MB:.1f} MB ({grown / tracked - 1:+.2%})"
    )
    assert tracked > 6 * big_tensor
    assert abs(grown / tracked - 1) <= 0.08, (grown, tracked)
