"""glibc malloc in the ranks: start-up thresholds from the launcher, raised for the steps by the rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleetwise.launcher.torchrun import HOST_MALLOC, rank_malloc_env
from fleetwise.runtime.hostmalloc import OWNED_VAR, steady_malloc

# One process with the launcher's start-up setting: minor page faults of allocating, touching and
# freeing a 9 MiB block five times (a d=768 GPT's weight gradient), before and after steady_malloc.
PROBE = """
import ctypes, json, resource
from fleetwise.runtime.hostmalloc import steady_malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        p = libc.malloc(9 << 20)
        ctypes.memset(p, 1, 9 << 20)
        libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
start = faults()
fsdp = steady_malloc("fsdp")
after_fsdp = faults()
ddp = steady_malloc("ddp")
print(json.dumps({"start": start, "fsdp": fsdp, "after_fsdp": after_fsdp, "ddp": ddp, "steady": faults()}))
"""


def test_launcher_owns_the_thresholds_only_where_the_user_set_none():
    mine = rank_malloc_env({"PATH": "/bin"})
    assert mine == {**HOST_MALLOC, OWNED_VAR: "1"}
    # a user's threshold wins, and then the rank leaves both alone (even with a stale marker around)
    theirs = rank_malloc_env({"MALLOC_MMAP_THRESHOLD_": "131072", OWNED_VAR: "1"})
    assert "MALLOC_MMAP_THRESHOLD_" not in theirs and theirs[OWNED_VAR] == "0"
    assert theirs["MALLOC_TRIM_THRESHOLD_"] == HOST_MALLOC["MALLOC_TRIM_THRESHOLD_"]
    assert steady_malloc("ddp", environ={OWNED_VAR: "0"}) is False
    assert steady_malloc("ddp", environ={}) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_steady_malloc_stops_the_per_step_page_faults_except_under_fsdp():
    env = {**os.environ, **HOST_MALLOC, OWNED_VAR: "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    pages = (9 << 20) // 4096  # 2304 pages per block
    # start-up setting: every block is mapped anew and faulted in page by page
    assert r["start"] >= 4 * pages, r
    assert r["fsdp"] is False and r["after_fsdp"] >= 4 * pages, r  # FSDP keeps the low threshold
    # raised: the heap keeps the block; at most the first allocation grows it
    assert r["ddp"] is True and r["steady"] <= pages + 200, r
