"""Side-by-side view of runs: a table (terminal, markdown) and a PNG chart of throughput and memory.

Used by `fleetwise compare` and by the sweep callback for the parent run of a multirun. A run's
numbers come from its summary metrics when it has them (a finished run), otherwise from its
latest per-step values (a run that is still going or died early).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetwise.rundir import Metric, Summary

SWEEP_PARENT_TAG = "fleetwise.sweep"  # value "parent" on the parent run of a multirun


@dataclass
class RunRow:
    run_id: str
    name: str
    strategy: str
    world_size: str
    status: str
    throughput: float | None
    unit: str  # "tokens/s" or "samples/s"
    mfu: float | None
    peak_bytes: float | None
    predicted_bytes: float | None
    final_loss: float | None
    params: dict[str, str] | None = None  # the run's logged config, for the "differs" column
    samples_per_s: float | None = None  # every run has it: the chart's one throughput axis
    loss_curve: list[tuple[int, float]] | None = None  # (step, train/loss): add_loss_curves

    @property
    def label(self) -> str:
        return f"{self.name} ({self.strategy}, {self.world_size} ranks)"


def _first(metrics: dict[str, float], *keys: str) -> float | None:
    return next((metrics[k] for k in keys if k in metrics), None)


def row_from_run(run: Any) -> RunRow:
    m, tags = run.data.metrics, run.data.tags
    tokens = _first(m, Summary.TOKENS_PER_S, Metric.TOKENS_PER_S)
    samples = _first(m, Summary.SAMPLES_PER_S, Metric.SAMPLES_PER_S)
    return RunRow(
        run_id=run.info.run_id,
        name=run.info.run_name or run.info.run_id[:8],
        strategy=tags.get("fleetwise.strategy", "?"),
        world_size=tags.get("fleetwise.world_size", "?"),
        status=run.info.status,
        throughput=tokens if tokens is not None else samples,
        unit="tokens/s" if tokens is not None else "samples/s",
        mfu=_first(m, Summary.MFU, Metric.MFU),
        peak_bytes=_first(m, Summary.PEAK_BYTES_MAX, Metric.PEAK_BYTES_MAX),
        predicted_bytes=_first(m, Summary.PREDICTED_BYTES, Metric.PREDICTED_BYTES),
        # run.data.metrics holds each metric at its largest step: the loss at the last step.
        final_loss=_first(m, Summary.FINAL_LOSS, Metric.LOSS),
        params=dict(run.data.params),
        samples_per_s=samples,
    )


def add_loss_curves(mlflow_client: Any, rows: list[RunRow]) -> list[RunRow]:
    """Each row's train/loss per step, for the chart's loss panel (a run without it gets none)."""
    for row in rows:
        try:
            history = mlflow_client.get_metric_history(row.run_id, Metric.LOSS)
        except Exception:  # noqa: BLE001 - a chart without one curve beats no chart
            history = []
        row.loss_curve = sorted((m.step, m.value) for m in history) or None
    return rows


# params that differ between any two runs by construction, never what a comparison is about
_INCIDENTAL = ("run.", "launch.rdzv", "tracking.", "checkpoint.resume")


def differing(rows: list[RunRow], limit: int = 3) -> list[str]:
    """The config keys whose values differ between the rows (at most `limit`, sorted): what a
    comparison of runs is about (two rows both named gpt-tiny-sharding-cpu differ in something)."""
    if len(rows) < 2:
        return []
    keys = sorted({k for r in rows for k in (r.params or {})})
    out = [
        k for k in keys if not k.startswith(_INCIDENTAL) and len({(r.params or {}).get(k) for r in rows}) > 1
    ]
    return out[:limit]


def resolve_run_id(mlflow_client: Any, run_id: str) -> Any:
    """A run by its id or an unambiguous prefix of it (the 8 characters the table shows)."""
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_run(run_id)
    except MlflowException:
        if len(run_id) >= 32:
            raise
    exps = [e.experiment_id for e in mlflow_client.search_experiments()]
    found = [r for r in mlflow_client.search_runs(exps, max_results=5000) if r.info.run_id.startswith(run_id)]
    if len(found) != 1:
        what = "no run" if not found else f"{len(found)} runs"
        raise ValueError(f"{what} with an id starting {run_id!r}; give more of the id")
    return found[0]


def find_runs(
    mlflow_client: Any, *, experiment: str | None = None, run_ids: list[str] | None = None, limit: int = 20
) -> list[Any]:
    """The runs to compare: the given ids (a sweep parent stands for its children), or the newest
    `limit` runs of an experiment, sweep parents left out, newest first (a sweep's children stay in
    the order they ran)."""
    if run_ids:
        runs = []
        for run_id in run_ids:
            run = resolve_run_id(mlflow_client, run_id)
            children = child_runs(mlflow_client, run) if _is_parent(run) else []
            runs.extend(children or [run])
        return runs
    exp = mlflow_client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    found = mlflow_client.search_runs(
        [exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=limit * 2
    )
    return [r for r in found if not _is_parent(r)][:limit]


def child_runs(mlflow_client: Any, parent: Any) -> list[Any]:
    found = mlflow_client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=1000,
    )
    return list(found)


def _is_parent(run: Any) -> bool:
    return run.data.tags.get(SWEEP_PARENT_TAG) == "parent"


# ------------------------------------------------------------------------------------------------
# rendering


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(row: RunRow) -> str:
    if row.throughput is None:
        return "-"
    value = row.throughput
    text = f"{value / 1000:.3g}k" if value >= 1000 else f"{value:.3g}"
    return f"{text} {row.unit}"


def _cells(row: RunRow, keys: list[str]) -> list[str]:
    params = row.params or {}
    return [
        row.run_id[:8],
        row.name,
        *(params.get(k, "-") for k in keys),
        row.strategy,
        row.world_size,
        row.status,
        fmt_rate(row),
        "-" if row.mfu is None else f"{100 * row.mfu:.1f}%",
        fmt_bytes(row.peak_bytes),
        fmt_bytes(row.predicted_bytes),
        "-" if row.final_loss is None else f"{row.final_loss:.4g}",
    ]


HEADERS = [
    "run id",
    "run",
    "strategy",
    "world size",
    "status",
    "throughput",
    "MFU",
    "peak mem",
    "predicted mem",
    "final loss",
]


def rich_table(rows: list[RunRow], title: str | None = None):
    from rich.table import Table

    table = Table(title=title)
    keys = differing(rows)
    headers = _headers(keys)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < 5 + len(keys) else "right")
    for row in rows:
        table.add_row(*_cells(row, keys))
    return table


def _headers(keys: list[str]) -> list[str]:
    return HEADERS[:2] + keys + HEADERS[2:]


def markdown_table(rows: list[RunRow]) -> str:
    keys = differing(rows)
    headers = _headers(keys)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cells(row, keys)) + " |" for row in rows]
    lines.append("")
    lines += [f"- {row.name}: run id `{row.run_id}`" for row in rows]
    return "\n".join(lines) + "\n"


def _byte_unit(largest: float) -> tuple[str, float]:
    """The unit that shows the largest value as a number of a readable size (1.65 MiB, not 0.002 GiB)."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if largest >= size:
            return unit, size
    return "B", 1


def chart_data(rows: list[RunRow]) -> dict[str, Any]:
    """What the chart draws: samples/s for every run on one axis (tokens/s differ by model and would
    mix two units), memory in the unit that suits the largest value, and the loss curves."""
    peak = [row.peak_bytes or 0.0 for row in rows]
    pred = [row.predicted_bytes or 0.0 for row in rows]
    unit, size = _byte_unit(max(peak + pred + [0.0]))
    curves = {row.label: row.loss_curve for row in rows if row.loss_curve}
    return {
        "rate_label": "mean throughput (samples/s)",
        "rates": [row.samples_per_s or 0.0 for row in rows],
        "memory_label": f"peak memory per device ({unit})",
        "peak": [v / size for v in peak],
        "predicted": [v / size for v in pred],
        "loss": curves,
    }


def write_chart(rows: list[RunRow], path: Path, title: str = "fleetwise runs") -> Path:
    """A PNG with throughput per run, measured vs predicted peak memory, and the loss curves."""
    # The Figure API with the Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = chart_data(rows)
    labels = [row.label for row in rows]
    ys = list(range(len(rows)))
    height = max(3.0, 1.2 + 0.45 * max(len(rows), 1))
    panels = 3 if data["loss"] else 2
    fig = Figure(figsize=(6.5 * panels, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels)
    ax_rate, ax_mem = axes[0], axes[1]

    rates = data["rates"]
    ax_rate.barh(ys, rates, color="tab:blue")
    ax_rate.set_xlabel(data["rate_label"])
    ax_rate.set_yticks(ys, labels)
    ax_rate.invert_yaxis()
    for y, row in zip(ys, rows, strict=True):
        text = f"{rates[y]:,.3g} samples/s" + (f" · {fmt_rate(row)}" if row.unit == "tokens/s" else "")
        ax_rate.annotate(
            text, (rates[y], y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8
        )

    width = 0.4
    peak, pred = data["peak"], data["predicted"]
    ax_mem.barh([y - width / 2 for y in ys], peak, height=width, color="tab:red", label="measured peak")
    ax_mem.barh([y + width / 2 for y in ys], pred, height=width, color="tab:gray", label="predicted (plan)")
    ax_mem.set_yticks(ys, [""] * len(ys))
    ax_mem.invert_yaxis()
    ax_mem.set_xlabel(data["memory_label"])
    ax_mem.legend(loc="best", fontsize=8)
    # Head-room for the value labels and the legend.
    ax_rate.set_xlim(0, 1.5 * max(rates + [1e-9]))
    ax_mem.set_xlim(0, 1.35 * max(peak + pred + [1e-9]))
    if data["loss"]:
        ax_loss = axes[2]
        for label, curve in data["loss"].items():
            ax_loss.plot([s for s, _ in curve], [v for _, v in curve], label=label, linewidth=1.2)
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel(Metric.LOSS)
        ax_loss.legend(loc="best", fontsize=7)
    fig.suptitle(title)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
