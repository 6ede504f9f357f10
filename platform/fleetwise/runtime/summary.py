"""End-of-job summary: the numbers a user wants, from metrics.jsonl, warm-up steps excluded."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from fleetwise.config.run import RunConfig
from fleetwise.plan.planner import Plan


def summarize(records: list[dict], warmup_steps: int) -> dict[str, float]:
    """Throughput and time over the steps after warm-up (all steps if the run is shorter);
    memory over all steps (the peak is what matters); the last loss."""
    if not records:
        return {}
    steady = records[warmup_steps:] or records
    out = {
        "summary/step_time_median_s": statistics.median(r["perf/step_time_s"] for r in steady),
        "summary/samples_per_s_mean": statistics.fmean(r["perf/samples_per_s"] for r in steady),
        "summary/mfu_mean": statistics.fmean(r["perf/mfu"] for r in steady),
        "summary/peak_bytes_max": max(r["memory/peak_bytes_max"] for r in records),
        "summary/predicted_bytes": records[-1]["memory/predicted_bytes"],
        "summary/final_loss": records[-1]["train/loss"],
        "summary/steps": float(len(records)),
    }
    if "perf/tokens_per_s" in records[-1]:
        out["summary/tokens_per_s_mean"] = statistics.fmean(r["perf/tokens_per_s"] for r in steady)
    if out["summary/predicted_bytes"]:
        out["summary/memory_ratio"] = out["summary/peak_bytes_max"] / out["summary/predicted_bytes"]
    return out


def print_summary(console: Console, cfg: RunConfig, plan: Plan, result) -> dict[str, float]:
    s = summarize(result.records, cfg.train.warmup_steps_excluded)
    if not s:
        return s
    t = Table(
        title=f"summary ({int(s['summary/steps'])} steps, first {cfg.train.warmup_steps_excluded} "
        "excluded from throughput)",
        show_header=False,
        box=None,
        title_justify="left",
    )
    t.add_column(style="bold cyan")
    t.add_column()
    t.add_row("final loss", f"{s['summary/final_loss']:.4f}")
    rate = f"{s['summary/samples_per_s_mean']:,.1f} samples/s"
    if "summary/tokens_per_s_mean" in s:
        rate += f" · {s['summary/tokens_per_s_mean']:,.0f} tokens/s"
    t.add_row("throughput", rate)
    t.add_row(
        "step time",
        f"{s['summary/step_time_median_s'] * 1e3:,.1f} ms median (plan {plan.step_time_s * 1e3:,.1f} ms)",
    )
    t.add_row("MFU", f"{s['summary/mfu_mean']:.1%} (plan {plan.mfu:.1%})")
    mib = 2**20
    ratio = s.get("summary/memory_ratio")
    t.add_row(
        "peak memory",
        f"{s['summary/peak_bytes_max'] / mib:,.2f} MiB per device, max over ranks (plan "
        f"{s['summary/predicted_bytes'] / mib:,.2f} MiB" + (f", ratio {ratio:.3f})" if ratio else ")"),
    )
    console.print(t)
    return s
