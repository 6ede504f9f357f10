"""The probes of `fleetwise calibrate`, grouped by what they measure (torch is imported here, never
by the command's own side before it runs one):

    machine.py      measure(): every probe below, in order, on this machine (what each measures)
    compute.py      GEMMs: the peak, a training-shaped GEMM, the efficiency curve by size
    host.py         host work of a step: per-op dispatch, elementwise ops, gradient accumulation,
                    convolution set-up, the optimizer update, checkpointing, co-running ranks
    pipeline.py     torch.distributed.pipelining per schedule action, zero bubble's split backward
    parallel.py     DTensor, FSDP2 and ZeRO-1 against the same plain module on a 2-rank mesh
    collectives.py  all-reduce, reduce-scatter and all-gather between 2 processes; the link between nodes
    gpu.py          a GPU's own costs: GEMM curve, kernel floor, memory-bound ops, host link
    timing.py       best/median of repeated runs, interleaved twins, the slowest rank
    workloads.py    what the probes run and count (OpCounter, a chain of tiny blocks)
"""
