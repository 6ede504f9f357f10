"""Collective and link probes: all-reduce latency and bandwidth between 2 processes, their
reduce-scatter and all-gather, the link between nodes; the 2-process worker also runs the probes
that need a peer (parallel engines, pipeline actions, co-running)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fleetwise.calibrate.probes.host import co_run_slowdown
from fleetwise.calibrate.probes.parallel import (
    dtensor_op_us,
    fsdp_ns_per_param,
    fsdp_us_per_tensor,
    zero1_host_us,
)
from fleetwise.calibrate.probes.pipeline import pipeline_action_us
from fleetwise.calibrate.probes.timing import slowest

LATENCY_BYTES = 4
BANDWIDTH_BYTES = 16 * 2**20


def allreduce_worker(rank: int, world: int, init_file: str, backend: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        # NCCL binds a communicator to the current device: without this every rank would use GPU 0
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    results = {}
    for nbytes, reps in ((LATENCY_BYTES, 200), (BANDWIDTH_BYTES, 10)):
        t = torch.ones(nbytes // 4, device=device)
        for _ in range(3):
            dist.all_reduce(t)
        sync()
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            sync()
            times.append(time.perf_counter() - start)
        # every rank's median; the slowest rank decides when the collective is done
        results[nbytes] = slowest(statistics.median(times))
    results.update(_shard_collectives(world, rank, device, sync))
    if backend == "gloo":  # on GPUs DTensor's host work overlaps the kernels
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        results["dtensor_op_us"] = slowest(dtensor_op_us(mesh, results[LATENCY_BYTES]))
        results["fsdp_us_per_tensor"] = slowest(fsdp_us_per_tensor(mesh, results[LATENCY_BYTES]))
        results["fsdp_ns_per_param"] = slowest(fsdp_ns_per_param(mesh, results["fsdp_us_per_tensor"]))
        results["co_run_slowdown"] = co_run_slowdown()
        single, multi = pipeline_action_us(results[LATENCY_BYTES])
        results["pipeline_action_us"], results["pipeline_multi_action_us"] = slowest(single), slowest(multi)
        zero_mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("dp", "sharding", "mp"))
        hook, step = zero1_host_us(zero_mesh, results[LATENCY_BYTES])
        results["zero1_us_per_tensor"], results["zero1_step_us_per_tensor"] = slowest(hook), slowest(step)
    if rank == 0:
        Path(out_file).write_text(repr(results))
    dist.destroy_process_group()
    from fleetwise.runtime.mesh import exit_finished

    exit_finished()  # the probes' meshes keep process groups alive past destroy_process_group


def _shard_collectives(world: int, rank: int, device, sync, reps: int = 10) -> dict[str, float]:
    """Seconds (median, slowest rank) of a reduce-scatter of BANDWIDTH_BYTES and of an all-gather
    into BANDWIDTH_BYTES, the collectives of ZeRO-1 and FSDP, keyed "reduce_scatter" / "all_gather"."""
    import torch.distributed as dist

    from fleetwise.compat import all_gather_single, reduce_scatter_single

    whole = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    piece = torch.ones(BANDWIDTH_BYTES // 4 // world, device=device)
    ops = {
        "reduce_scatter": lambda: reduce_scatter_single(piece, whole),
        "all_gather": lambda: all_gather_single(whole, piece),
    }
    out = {}
    for name, op in ops.items():
        op()
        sync()
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            op()
            sync()
            times.append(time.perf_counter() - start)
        out[name] = slowest(statistics.median(times))
    return out


def allreduce_speed(backend: str, world: int = 2) -> dict[str, float]:
    """Latency (µs) and bandwidth (GB/s per direction) of an all-reduce between `world` processes,
    and (gloo only) the extra µs per forward op of a tensor-parallel module between them, per FSDP
    unit pass and parameter tensor, and the slowdown of host work run by all of them at once;
    keyed by Calibration's field names."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fleetwise-calibrate-") as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(allreduce_worker, args=(world, init_file, backend, out_file), nprocs=world, join=True)
        results = eval(Path(out_file).read_text())  # noqa: S307 - a dict of floats we wrote ourselves
    latency = results[LATENCY_BYTES]
    moved = 2 * (world - 1) / world * BANDWIDTH_BYTES  # bytes each rank sends in a ring all-reduce
    bandwidth = moved / max(results[BANDWIDTH_BYTES] - latency, 1e-9)
    # reduce-scatter and all-gather: ring volume (n-1)/n of the whole buffer, the planner's convention
    shard = {
        f"{name}_gbps": (world - 1) / world * BANDWIDTH_BYTES / max(results.pop(name) - latency, 1e-9) / 1e9
        for name in ("reduce_scatter", "all_gather")
    }
    probes = {k: v for k, v in results.items() if isinstance(k, str)}  # gloo: the DTensor/FSDP/co-run probes
    return {"allreduce_latency_us": latency * 1e6, "allreduce_gbps": bandwidth / 1e9, **shard, **probes}


def inter_node_speed(nodes: int, node_rank: int, endpoint: str, timeout_s: float = 300.0) -> dict[str, float]:
    """Latency (µs) and bandwidth (GB/s per direction) of a gloo all-reduce between `nodes`
    machines, this process being node `node_rank`'s one rank; they meet at `endpoint` HOST:PORT,
    where node 0 hosts the store. gloo uses the interface of the kernel's route to HOST (as
    `fleetwise train` does) unless GLOO_SOCKET_IFNAME is set. Keyed by Calibration's field names."""
    from datetime import timedelta

    import torch.distributed as dist

    from fleetwise.hostnet import interface_env, node_network

    net = node_network(endpoint)
    os.environ.update(interface_env(net, os.environ))
    host, _, port = endpoint.rpartition(":")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host.strip("[]"), int(port), nodes, is_master=node_rank == 0, timeout=timeout, wait_for_workers=False
    )
    dist.init_process_group("gloo", store=store, rank=node_rank, world_size=nodes, timeout=timeout)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for nbytes, reps in ((LATENCY_BYTES, 100), (BANDWIDTH_BYTES, 8)):
            t = torch.ones(nbytes // 4)
            for _ in range(2):
                dist.all_reduce(t)
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            results[nbytes] = slowest(statistics.median(times))
        dist.barrier()
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()
    latency = results[LATENCY_BYTES]
    moved = 2 * (nodes - 1) / nodes * BANDWIDTH_BYTES
    bandwidth = moved / max(results[BANDWIDTH_BYTES] - latency, 1e-9)
    return {"inter_node_latency_us": latency * 1e6, "inter_node_gbps": bandwidth / 1e9}
