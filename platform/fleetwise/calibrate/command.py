"""The `fleetwise calibrate` command: run the probes, write the profile YAML, update the link keys.

The command's own side is torch-free: torch loads with the first probe it runs, after the options
are checked (a wrong option exits 2 at once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fleetwise.calibrate.calibration import Calibration
from fleetwise.calibrate.profile import profile, profile_yaml, update_link
from fleetwise.config.compose import user_config_dir

EXIT_OK, EXIT_INVALID = 0, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetwise calibrate", description=main.__doc__)
    p.add_argument("--name", default="local", help="profile name (select it with hardware=NAME)")
    p.add_argument(
        "--out",
        help="profile file (default: $FLEETWISE_CONFIG_DIR or ~/.config/fleetwise, hardware/NAME.yaml, "
        "which fleetwise searches after its own conf/)",
    )
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.add_argument("--no-comm", action="store_true", help="skip the 2-process all-reduce measurement")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a fifth of each probe's repetitions: the same keys, noisier (a first look, or a check that "
        "calibrate runs here)",
    )
    link = p.add_argument_group(
        "the link between nodes: run the same command on every node at once (one process each)"
    )
    link.add_argument("--nodes", type=int, default=1, help="machines taking part (> 1: measure the link)")
    link.add_argument("--node-rank", type=int, default=0, help="this machine's rank (0: hosts the store)")
    link.add_argument("--endpoint", help="HOST:PORT, HOST being node 0's address (as launch.rdzv_endpoint)")
    link.add_argument(
        "--link-only", action="store_true", help="measure only the link; update the profile's inter-node keys"
    )
    return p


def _problems(args: argparse.Namespace, out: Path) -> list[str]:
    problems = []
    if args.nodes > 1 and not args.endpoint:
        problems.append("--nodes > 1 needs --endpoint HOST:PORT (node 0's address and a free port)")
    if not 0 <= args.node_rank < max(1, args.nodes):
        problems.append(
            f"--node-rank {args.node_rank}: must be 0..{args.nodes - 1} with --nodes {args.nodes}"
        )
    if args.link_only and args.nodes < 2:
        problems.append("--link-only measures the link between nodes: give --nodes N (N > 1) and --endpoint")
    if args.link_only and not out.exists():
        problems.append(
            f"--link-only updates an existing profile: {out} does not exist (run without --link-only)"
        )
    return problems


def link_backend_problem(profile_backend: str, cuda: bool) -> str | None:
    """Why the link between nodes cannot be measured for a profile here, or None. The link is
    measured with the backend of the jobs that will use the profile: a GPU profile's (nccl) rate
    between nodes is InfiniBand's or RoCE's through NCCL; timed with gloo over TCP, as this command
    once did, it was written as the NCCL rate while being another link's."""
    if profile_backend == "nccl" and not cuda:
        return (
            "the profile's backend is nccl, but this machine has no CUDA device: the link between "
            "nodes is measured with NCCL, on the GPU nodes themselves (gloo over TCP is another link's "
            "rate); run this command there, or give a gloo profile"
        )
    return None


def _link_only(link: dict, out: Path, as_json: bool) -> int:
    import torch
    import yaml

    from fleetwise.calibrate.probes.collectives import inter_node_speed

    backend = (yaml.safe_load(out.read_text()) or {}).get("backend", "gloo")
    problem = link_backend_problem(backend, torch.cuda.is_available())
    if problem:
        print(f"✗ fleetwise calibrate: {problem}", file=sys.stderr)
        return EXIT_INVALID
    speed = inter_node_speed(**link, backend=backend)
    out.write_text(update_link(out, speed, backend))
    if as_json:
        print(json.dumps({"measured": speed, "path": str(out)}, indent=2))
    else:
        print(
            f"✓ between nodes ({backend}): latency {speed['inter_node_latency_us']:,.0f} µs, bandwidth "
            f"{speed['inter_node_gbps']:.4g} GB/s; written to {out}"
        )
    return EXIT_OK


def _summary(cal: Calibration, out: Path, name: str) -> None:
    from rich.console import Console

    Console().print(
        f"[green]✓[/] peak fp32 {cal.peak_flops['fp32'] / 1e9:,.1f} GFLOP/s ({cal.cores} cores; one thread "
        f"{cal.single_thread_flops / 1e9:,.1f}) · matmul efficiency {cal.matmul_efficiency:.2f} · op overhead "
        f"{cal.op_overhead_us:.1f} µs · all-reduce {cal.allreduce_latency_us:,.0f} µs, "
        f"{cal.allreduce_gbps:.2f} GB/s (reduce-scatter {cal.reduce_scatter_gbps or 0:.2f}, all-gather "
        f"{cal.all_gather_gbps or 0:.2f})\n  host costs: elementwise {cal.elementwise_ns:.2f} ns · update "
        f"{cal.update_us_per_tensor:.0f} µs/tensor + {cal.update_ns_per_param:.2f} ns/param · conv call "
        f"{cal.conv_call_us:.0f} µs · checkpointing {cal.checkpoint_op_us:.0f} µs/op (selective "
        f"{cal.selective_checkpoint_op_us:.0f}) · DTensor {cal.dtensor_op_us:.0f} µs/op · FSDP "
        f"{cal.fsdp_us_per_tensor:.0f} µs/unit pass·tensor · ZeRO-1 {cal.zero1_us_per_tensor:.0f} µs/tensor·"
        f"micro-batch + {cal.zero1_step_us_per_tensor:.0f} µs/tensor·step · zero-bubble split "
        f"{cal.zero_bubble_split_op_us:.0f} µs/op + {cal.zero_bubble_split_ns_per_param:.2f} ns/param · co-run "
        f"slowdown {cal.co_run_slowdown:.2f}"
        f"\n  profile written to {out}: use hardware={name}",
        highlight=False,
    )


def main(argv: list[str]) -> int:
    """`fleetwise calibrate [--out PATH] [--name NAME] [--json] [--no-comm] [--quick]`: measure peak matmul,
    per-op overhead and all-reduce speed here, and write a hardware profile (hardware=NAME)."""
    args = _parser().parse_args(argv)
    out = Path(args.out) if args.out else user_config_dir() / "hardware" / f"{args.name}.yaml"
    problems = _problems(args, out)
    if problems:
        for problem in problems:
            print(f"✗ fleetwise calibrate: {problem}", file=sys.stderr)
        return EXIT_INVALID
    link = {"nodes": args.nodes, "node_rank": args.node_rank, "endpoint": args.endpoint}
    if args.link_only:
        return _link_only(link, out, args.json)
    from fleetwise.calibrate.probes.machine import measure
    from fleetwise.calibrate.probes.timing import QUICK, set_share

    if args.quick:
        set_share(QUICK)
    cal = measure(comm=not args.no_comm, link=link if args.nodes > 1 else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile_yaml(cal, args.name))
    if args.json:
        print(
            json.dumps(
                {"measured": cal.to_dict(), "profile": profile(cal, args.name), "path": str(out)}, indent=2
            )
        )
    else:
        _summary(cal, out, args.name)
    return EXIT_OK
