"""Collective and link probes: all-reduce latency and bandwidth between the processes of a node (2
on a CPU, every GPU on a GPU node), their reduce-scatter and all-gather, the link between nodes;
the gloo worker also runs the probes that need a peer (parallel engines, pipeline actions,
co-running).

Bandwidth is nccl-tests' bus bandwidth (doc/PERFORMANCE.md): the bytes each rank moves in the ring
-- 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for a reduce-scatter or an all-gather -- over
the time, less the per-call latency the planner charges on its own (comm_latency_us). NCCL reaches
its link rate only on large buffers, so a GPU node is measured up to 256 MiB and the best size
counts; gloo's rate is flat past a few MiB and a CPU node keeps the one 16 MiB buffer."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

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
BANDWIDTH_BYTES = 16 * 2**20  # gloo (CPU)
NCCL_BANDWIDTH_BYTES = (16 * 2**20, 64 * 2**20, 256 * 2**20)
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}
RING_FACTOR["all_gather"] = RING_FACTOR["reduce_scatter"]


def bandwidth_sizes(backend: str) -> tuple[int, ...]:
    """The buffer sizes (bytes) a backend's bandwidth is measured at."""
    return NCCL_BANDWIDTH_BYTES if backend == "nccl" else (BANDWIDTH_BYTES,)


def bus_gbps(op: str, nbytes: int, seconds: float, world: int, latency_s: float = 0.0) -> float:
    """nccl-tests' bus bandwidth of one collective `op` over `world` ranks on a buffer of `nbytes`
    (an all-reduce's buffer, a reduce-scatter's input, an all-gather's output) that took `seconds`:
    the ring volume each rank sends over the time less the call's fixed latency, in GB/s."""
    return RING_FACTOR[op](world) * nbytes / max(seconds - latency_s, 1e-9) / 1e9


def best_bus_gbps(op: str, seconds_by_size: dict[int, float], world: int, latency_s: float) -> float:
    """The best bus bandwidth over the measured sizes: the link's rate, which small buffers (launch
    and protocol set-up per call) never reach."""
    return max(bus_gbps(op, n, t, world, latency_s) for n, t in seconds_by_size.items())


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
    sizes = bandwidth_sizes(backend)
    for nbytes in (LATENCY_BYTES, *sizes):
        t = torch.ones(nbytes // 4, device=device)
        for _ in range(3):
            dist.all_reduce(t)
        sync()
        # every rank's median; the slowest rank decides when the collective is done
        results[nbytes] = slowest(
            _median_time(lambda t=t: dist.all_reduce(t), sync, reps=200 if nbytes == 4 else 10)
        )
        del t
    results.update(_shard_collectives(world, device, sync, sizes[-1]))
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


def _median_time(op, sync, reps: int) -> float:
    """Median seconds of `op` (each call between barriers, until the device finishes it)."""
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        op()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _shard_collectives(world: int, device, sync, nbytes: int, reps: int = 10) -> dict[str, float]:
    """Seconds (median, slowest rank) of a reduce-scatter of `nbytes` and of an all-gather into
    `nbytes`, the collectives of ZeRO-1 and FSDP, keyed "reduce_scatter" / "all_gather"."""
    from fleetwise.compat import all_gather_single, reduce_scatter_single

    whole = torch.ones(nbytes // 4, device=device)
    piece = torch.ones(nbytes // 4 // world, device=device)
    ops = {
        "reduce_scatter": lambda: reduce_scatter_single(piece, whole),
        "all_gather": lambda: all_gather_single(whole, piece),
    }
    out = {}
    for name, op in ops.items():
        op()
        sync()
        out[name] = slowest(_median_time(op, sync, reps))
    return {**out, "shard_bytes": nbytes}


def allreduce_speed(backend: str, world: int = 2) -> dict[str, float]:
    """Latency (µs) and bus bandwidth (GB/s per direction, see the module's note) of an all-reduce
    between `world` processes, of their reduce-scatter and all-gather, and (gloo only) the extra µs
    per forward op of a tensor-parallel module between them, per FSDP unit pass and parameter
    tensor, and the slowdown of host work run by all of them at once; keyed by Calibration's field
    names."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fleetwise-calibrate-") as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(allreduce_worker, args=(world, init_file, backend, out_file), nprocs=world, join=True)
        results = eval(Path(out_file).read_text())  # noqa: S307 - a dict of floats we wrote ourselves
    return speeds(results, world, backend)


def speeds(results: dict, world: int, backend: str) -> dict[str, float]:
    """Calibration's fields from the worker's seconds: keyed by buffer bytes (the all-reduces:
    LATENCY_BYTES and bandwidth_sizes(backend)), "reduce_scatter" / "all_gather" (of "shard_bytes"),
    and the gloo probes' own fields, passed on."""
    results = dict(results)
    latency = results.pop(LATENCY_BYTES)
    by_size = {n: results.pop(n) for n in bandwidth_sizes(backend)}
    nbytes = results.pop("shard_bytes")
    shard = {
        f"{op}_gbps": bus_gbps(op, nbytes, results.pop(op), world, latency)
        for op in ("reduce_scatter", "all_gather")
    }
    return {
        "allreduce_latency_us": latency * 1e6,
        "allreduce_gbps": best_bus_gbps("all_reduce", by_size, world, latency),
        **shard,
        **results,  # gloo: the DTensor/FSDP/co-run probes
    }


def inter_node_speed(
    nodes: int, node_rank: int, endpoint: str, timeout_s: float = 300.0, backend: str = "gloo"
) -> dict[str, Any]:
    """Latency (µs) and bus bandwidth (GB/s per direction) of an all-reduce between `nodes`
    machines over `backend` -- the job's: NCCL on GPU 0 of each node (its rate is InfiniBand's or
    RoCE's, not the TCP that gloo would time and a GPU profile would then misstate), gloo on CPUs --
    this process being node `node_rank`'s one rank; they meet at `endpoint` HOST:PORT, where node 0
    hosts the store. The backend uses the interface of the kernel's route to HOST (as `fleetwise
    train` does) unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is set. Keyed by Calibration's
    field names."""
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
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dist.init_process_group(
        backend,
        store=store,
        rank=node_rank,
        world_size=nodes,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for nbytes in (LATENCY_BYTES, *bandwidth_sizes(backend)):
            t = torch.ones(nbytes // 4, device=device)
            for _ in range(2):
                dist.all_reduce(t)
            sync()
            results[nbytes] = slowest(
                _median_time(lambda t=t: dist.all_reduce(t), sync, reps=100 if nbytes == 4 else 8)
            )
            del t
        dist.barrier()
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()
    latency = results.pop(LATENCY_BYTES)
    return {
        "inter_node_latency_us": latency * 1e6,
        "inter_node_gbps": best_bus_gbps("all_reduce", results, nodes, latency),
        "inter_node_backend": backend,
    }
