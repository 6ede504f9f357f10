"""compat's collectives on both of their paths, on 2 real gloo ranks: `dist.reduce_scatter_single` /
`all_gather_single` (torch 2.13, 2.14) and, with those two removed from torch.distributed as on
torch 2.11 and 2.12, the public `reduce_scatter_tensor` / `all_gather_into_tensor` that compat
falls back to. ZeRO-1 calls them on NCCL only (a gloo job takes its all-reduce path), so no CPU job
runs them: here ZeRO-1's reduce-scatter path steps a tiny model both ways, and the reference is
the SGD update worked out by hand."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts 2 processes (torch imports, a gloo rendezvous)

RANK_SCRIPT = r"""
import json, os
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from fleetwise import compat
from fleetwise.config.optim import OptimConfig
from fleetwise.runtime.optim import build_optimizer
from fleetwise.runtime.zero1 import Zero1

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp", "sharding", "mp"))
NEW = {n: getattr(dist, n) for n in ("reduce_scatter_single", "all_gather_single")}

def collectives():
    out, gathered = torch.empty(3), torch.empty(4)
    compat.reduce_scatter_single(out, torch.arange(6.0) + 10 * rank)
    compat.all_gather_single(gathered, torch.tensor([rank + 1.0, rank + 2.0]))
    return out.tolist(), gathered.tolist()

def zero1_step(all_reduce):
    torch.manual_seed(0)
    model = nn.Linear(3, 5)  # 5 rows over 2 ranks: uneven pieces (3 and 2)
    initial = {n: p.detach().clone().tolist() for n, p in model.named_parameters()}
    z = Zero1(model, OptimConfig(name="sgd", lr=0.5, grad_clip=None), mesh, working_dtype=torch.float32,
              grad_divisor=1, build_optimizer=build_optimizer, all_reduce=all_reduce)
    optimizer = z.build()
    model(torch.tensor([[1.0, 2.0, 3.0]]) * (rank + 1)).sum().backward()
    z.reduce()
    optimizer.step()
    z.gather()
    return initial, {n: p.detach().tolist() for n, p in model.named_parameters()}

out = {}
for path in ("2.13", "fallback"):
    for name, fn in NEW.items():
        if path == "fallback":
            delattr(dist, name)  # as on torch 2.11 and 2.12
        else:
            setattr(dist, name, fn)
    out[path] = {"collectives": collectives(), "zero1": zero1_step(all_reduce=False)}
out["all_reduce"] = {"zero1": zero1_step(all_reduce=True)}
out["fallback_had_no_new_names"] = not hasattr(dist, "reduce_scatter_single")
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_both_collective_paths_and_zero1_reduce_scatter_path_give_the_hand_worked_answer(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    results = [json.loads(o.split("RESULT ", 1)[1]) for o, _ in outs]
    for rank, res in enumerate(results):
        assert res["fallback_had_no_new_names"]
        for path in ("2.13", "fallback"):
            scattered, gathered = res[path]["collectives"]
            # inputs [0..5] and [10..15] summed = [10, 12, .., 20]; this rank's third of it
            assert scattered == [10.0 + 2 * i for i in range(6)][3 * rank : 3 * rank + 3], (path, rank)
            assert gathered == [1.0, 2.0, 2.0, 3.0], (path, rank)
        # one SGD step (lr 0.5) on the mean gradient of sum(W x + b) over x = [1,2,3] and [2,4,6]:
        # dW = outer(ones, mean x) = each row [1.5, 3, 4.5]; db = ones
        initial, _ = res["2.13"]["zero1"]
        expected = {
            "weight": [
                [w - 0.5 * g for w, g in zip(row, (1.5, 3.0, 4.5), strict=True)] for row in initial["weight"]
            ],
            "bias": [b - 0.5 for b in initial["bias"]],
        }
        for path in ("2.13", "fallback", "all_reduce"):
            start, after = res[path]["zero1"]
            assert start == initial, path  # every path started from the same weights
            got = [v for row in after["weight"] for v in row] + after["bias"]
            want = [v for row in expected["weight"] for v in row] + expected["bias"]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-6, (path, after, expected)
        # the two collective paths are the same arithmetic: equal to the bit
        assert res["2.13"]["zero1"][1] == res["fallback"]["zero1"][1]
    assert (
        results[0]["fallback"]["zero1"][1] == results[1]["fallback"]["zero1"][1]
    )  # every rank's whole weights
