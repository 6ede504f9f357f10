"""glibc malloc in a rank: a low mmap threshold while the model is built, glibc's own ceiling for the steps.

The launcher starts every rank with blocks from 4 MiB up mapped and unmapped (launcher/launch.py,
HOST_MALLOC): the whole-parameter temporaries of layout-invariant initialization then go back to the
system when freed instead of staying in the heap. The same threshold during the steps maps, and
faults in page by page, every tensor of 4 MiB or more each time it is allocated: a GPT of d=768 has
weight gradients and AdamW's per-parameter temporaries of 7-9 MiB. Measured on this machine, one
process, OMP_NUM_THREADS=1, AdamW step of a 6-layer d=768 GPT (median of 6 steps): 4 MiB threshold
61-63k minor page faults and 110 ms of system time per step, step 368-476 ms; glibc defaults 32-43k
faults, 70 ms, 257-287 ms (its adaptive threshold rises to the block sizes it sees, but it trims the
heap top at twice that); 32 MiB mmap / 64 MiB trim threshold 0 faults, 0 ms, 128-155 ms. Forward +
backward: 13-24k faults, 20-27 ms of system time at 4 MiB, none at 32 MiB.

So once the model is built a rank raises the thresholds to glibc's ceiling (32 MiB, the most its
own adaptation reaches on 64-bit; trim at twice that) -- except under FSDP, whose per-unit
all-gather buffers are what the low threshold keeps out of the heap in steady state (the 0.84B
ZeRO-3 job's RSS per rank, README) -- and only when the launcher set the thresholds, not the user.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from fleetwise.config.engine import Engine

# set by the launcher when it chose the thresholds (the user's environment set neither)
OWNED_VAR = "FLEETWISE_MALLOC_OWNED"
STEADY_MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
STEADY_TRIM_THRESHOLD = 64 << 20
# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def steady_malloc(engine: Engine, environ=os.environ) -> bool:
    """Raise glibc's mmap/trim thresholds for the training steps (see the module docstring). Returns
    whether it did: not under FSDP, not where the user set the thresholds, not without glibc."""
    if environ.get(OWNED_VAR) != "1" or engine == Engine.FSDP:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator is its own
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the trim threshold first: a heap top above it is given back at once
    return bool(mallopt(M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD)) and bool(
        mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
    )
