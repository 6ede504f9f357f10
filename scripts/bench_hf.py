"""fleetwise's Llama against transformers' LlamaForCausalLM: the same weights, the same batch, the same
optimizer, training steps taking turns in one process (tokens/s of each, and their ratio).

    python scripts/bench_hf.py OUT.json [--reps 5] [--steps 4]                      one process
    torchrun --nproc-per-node=2 scripts/bench_hf.py OUT.json [--reps 5] [--steps 4]  2-rank FSDP

A random LlamaForCausalLM (Llama 3's shape scaled down: GQA, SwiGLU, RoPE θ 500,000) is written to a
temporary directory by transformers itself; fleetwise reads it back (`fleetwise.load_model(DIR)`),
so both models start from the same tensors. Each repetition runs `--steps` training steps (forward,
cross entropy, backward, AdamW) of one model, then of the other, on the same token batch, A B then
B A alternately so that machine noise and warm caches hit both alike; one warm-up step each first.
Under torchrun both models are wrapped alike with FSDP2 (`fully_shard` per decoder layer, then the
root; gloo) and each rank trains on its own half of the batch. The ratio of a repetition is
fleetwise's tokens/s over transformers'; the median over repetitions is reported with its spread,
and the first step's losses of the two (they must agree: same weights, same batch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# ~20M parameters: large enough that a step takes tenths of a second here (per-op costs do not
# dominate), small enough to run in a minute on 2 cores
HF_CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
BATCH, SEQ = 4, 256


def build(directory: Path, world: int):
    """(transformers model, fleetwise model), the same weights, in train mode; FSDP2-wrapped alike
    when world > 1."""
    import transformers

    import fleetwise

    if int(os.environ.get("RANK", "0")) == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).save_pretrained(directory)
    if world > 1:
        dist.barrier()
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa").train()
    ours = fleetwise.load_model(directory).train()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in hf.model.layers:
            fully_shard(layer)
        fully_shard(hf)
        for layer in ours.layers.values():
            fully_shard(layer)
        fully_shard(ours)
    return hf, ours


def step_fns(hf, ours, tokens: torch.Tensor, labels: torch.Tensor):
    """One training step of each: forward, mean next-token cross entropy, backward, AdamW."""
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in (("hf", hf), ("ours", ours))}

    def loss_of(logits):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def hf_step() -> float:
        loss = loss_of(hf(input_ids=tokens).logits)
        loss.backward()
        opts["hf"].step()
        opts["hf"].zero_grad(set_to_none=True)
        return loss.item()

    def our_step() -> float:
        loss = loss_of(ours(tokens))
        loss.backward()
        opts["ours"].step()
        opts["ours"].zero_grad(set_to_none=True)
        return loss.item()

    return {"transformers": hf_step, "fleetwise": our_step}


def timed(fn, steps: int, world: int) -> float:
    """Seconds for `steps` steps (every rank's, the slowest counts: a barrier at both ends)."""
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if world > 1:
        dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, HF_CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # each rank's half of the batch
    tokens, labels = seq[mine, :-1].contiguous(), seq[mine, 1:].contiguous()
    # beside OUT, so that every rank reads the one rank 0 wrote
    directory = args.out.parent / f"{args.out.stem}_model"
    hf, ours = build(directory, world)
    steps = step_fns(hf, ours, tokens, labels)
    first = {name: fn() for name, fn in steps.items()}  # warm-up, and the two must agree
    times: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(args.reps):
        order = list(steps) if rep % 2 == 0 else list(reversed(steps))
        for name in order:
            times[name].append(timed(steps[name], args.steps, world))
    tokens_per_rep = BATCH * SEQ * args.steps  # the whole job's tokens
    tps = {name: [tokens_per_rep / t for t in ts] for name, ts in times.items()}
    ratios = [a / b for a, b in zip(tps["fleetwise"], tps["transformers"], strict=True)]
    if rank == 0:
        result = {
            "ranks": world,
            "model": {**HF_CONFIG, "batch": BATCH, "seq_len": SEQ},
            "reps": args.reps,
            "steps": args.steps,
            "first_loss": first,
            "tokens_per_s": {name: statistics.median(v) for name, v in tps.items()},
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "load_average": os.getloadavg()[0],
        }
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        shutil.rmtree(directory, ignore_errors=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
