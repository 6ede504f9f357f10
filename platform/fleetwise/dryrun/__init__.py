"""`fleetwise dryrun`: the real per-rank runtime of a job of any size, on fake tensors and the fake
process group; the planner held against it.

    parent.py    the parent side: which ranks, one process each (forkserver), reports beside the plan
    rank.py      one simulated rank: `simulate_rank` around the unchanged Trainer, `main` (its process)
    fake.py      the fake-execution harness: fake world, fake tensors, host reads, metadata relay
                 (shared with tests/helpers/cuda_semantics.py)
    counters.py  FLOPs, collective bytes and host reads per step (one dispatch mode), state bytes
    sampling.py  two small micro-batch and block counts simulated, every count scaled (affine)
    patches.py   every change the dry run makes to torch, and the private torch names it reads

The parent imports no torch; the rank side runs only in the processes it starts.
"""
