"""The run directory: everything that crosses the boundary between the launcher and the ranks.

The launcher writes the resolved config, the plan and the command line; every rank reads them
(no rank re-runs Hydra); rank 0 appends one metric record per optimizer step; the launcher,
`fleetwise sync`, `compare`, the summary and the benchmarks read those records back. File names,
the typed plan and every metric name are defined here once, so both sides agree by construction.

    config.yaml        resolved, validated config
    plan.json          the plan (`fleetwise plan --json` without remedies)
    command.txt        the command line
    metrics.jsonl      one record per optimizer step: `step`, `time` and metric names below
    tracking.json      the MLflow run id and how far delivery got (tracking/spool.py)
    ps_summary.json    parameter-server jobs: per-trainer and per-server totals
    auto_search.json   strategy=auto: the chosen override and the candidate table
    logs/rank_N.log    per-rank logs; logs/launcher.log: torchrun's own
    checkpoints/       DCP checkpoints (runtime/checkpoint_files.py)
    model/             the final weights (DCP shards) of a job without checkpoints, for MLflow
    data_index.npz     data=jsonl: which lines each packed row holds (data/jsonl.py), so that a
                       rank reads and tokenizes only its own rows' lines

Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import yaml

from fleetwise.config.run import RunConfig
from fleetwise.plan.records import Plan

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
COMMAND_FILE = "command.txt"
METRICS_FILE = "metrics.jsonl"
TRACKING_FILE = "tracking.json"
ERROR_FILE = "error.txt"  # why the job failed, for `fleetwise sync` and the MLflow run
PS_SUMMARY_FILE = "ps_summary.json"  # parameter-server jobs: per-trainer and per-server totals
AUTO_SEARCH_FILE = "auto_search.json"  # strategy=auto: the chosen override and the candidate table
LOGS_DIR = "logs"
LAUNCHER_LOG = "launcher.log"
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"  # the final weights as DCP shards, when no checkpoint holds them
DATA_INDEX_FILE = "data_index.npz"  # data=jsonl: the packing index every rank reads
# `fleetwise dryrun`'s pipeline metadata relay (dryrun/fake.py MetaRelay), in its temporary run
# directory: the stages' metadata files, and which stages run (dryrun/parent.py stand_ins)
PIPELINE_META_DIR = "pipeline_meta"
STAND_INS_FILE = "stand_ins.json"
# What a run's MLflow record carries as artifacts, besides the logs.
RUN_ARTIFACTS = (CONFIG_FILE, PLAN_FILE, COMMAND_FILE)


class Metric:
    """Names of the per-step metrics (metrics.jsonl keys = MLflow metric names)."""

    LOSS = "train/loss"
    LR = "train/lr"
    GRAD_NORM = "train/grad_norm"
    SKIPPED_STEPS = "train/skipped_steps"
    LOSS_SCALE = "train/loss_scale"  # fp16 only: GradScaler's scale after the step
    ATTEMPT = "job/attempt"  # torchrun's restart count: a restart shows as a step up in MLflow
    WORLD_SIZE = "job/world_size"  # ranks training this step (an elastic job shrinks or grows)
    STEP_TIME = "perf/step_time_s"
    SAMPLES_PER_S = "perf/samples_per_s"
    TOKENS_PER_S = "perf/tokens_per_s"
    TFLOPS_PER_DEVICE = "perf/tflops_per_device"
    MFU = "perf/mfu"
    PEAK_BYTES_MAX = "memory/peak_bytes_max"
    PEAK_BYTES_MEAN = "memory/peak_bytes_mean"
    RSS_PEAK_BYTES_MAX = "memory/rss_peak_bytes_max"
    PREDICTED_BYTES = "memory/predicted_bytes"
    RESERVED_BYTES_MAX = "memory/reserved_bytes_max"  # CUDA: what the caching allocator holds
    # a mixture of experts (runtime/moe.py), over the whole job: the balance losses added to the
    # loss (summed over the MoE blocks, a micro-batch's mean; train/loss leaves them out), the
    # (token, expert) slots dropped over capacity in the step, and the worst block's most loaded
    # expert's tokens over the mean (1: balanced); per block: `moe_layer_metric`
    MOE_AUX_LOSS = "moe/aux_loss"
    MOE_DROPPED = "moe/dropped_tokens"
    MOE_LOAD = "moe/load_max_over_mean"
    # parameter server jobs
    SAMPLES_PER_S_PER_TRAINER = "perf/samples_per_s_per_trainer"
    SERVER_BYTES_MAX = "memory/server_bytes_max"
    PS_PULL_LATENCY = "ps/pull_latency_s"
    PS_PUSH_LATENCY = "ps/push_latency_s"
    PS_WAIT = "ps/wait_s"
    PS_COMPUTE = "ps/compute_s"
    PS_BYTES_PULLED = "ps/bytes_pulled"
    PS_BYTES_PUSHED = "ps/bytes_pushed"
    PS_DENSE_BYTES_PULLED = "ps/dense_bytes_pulled"
    PS_SPARSE_BYTES_PULLED = "ps/sparse_bytes_pulled"
    PS_SPARSE_ROWS_PULLED = "ps/sparse_rows_pulled"
    PS_STALENESS = "ps/staleness"


def moe_layer_metric(layer: int, what: str) -> str:
    """A MoE block's own metric: `load_max_over_mean`, or `tokens_expert<i>` (tokens routed to expert i
    in the step, whole job)."""
    return f"moe/layer{layer}/{what}"


class Summary:
    """Names of the end-of-run summary metrics (tracking/summary.py computes them)."""

    STEPS = "summary/steps"
    STEPS_MEASURED = "summary/steps_measured"
    STEP_TIME_MEDIAN = "summary/step_time_median_s"
    STEP_TIME_MEAN = "summary/step_time_mean_s"
    SAMPLES_PER_S = "summary/samples_per_s_mean"
    TOKENS_PER_S = "summary/tokens_per_s_mean"
    TFLOPS_PER_DEVICE = "summary/tflops_per_device_mean"
    MFU = "summary/mfu_mean"
    PEAK_BYTES_MAX = "summary/peak_bytes_max"
    PREDICTED_BYTES = "summary/predicted_bytes"
    MEMORY_RATIO = "summary/memory_ratio"
    FINAL_LOSS = "summary/final_loss"


# Keys of a metric record that are not metrics.
RECORD_KEYS = frozenset({"step", "time"})


# --------------------------------------------------------------------------------------------------
# paths


def logs_dir(run_dir: Path) -> Path:
    return Path(run_dir) / LOGS_DIR


def rank_log(run_dir: Path, rank: int | str) -> Path:
    return logs_dir(run_dir) / f"rank_{rank}.log"


def rank_logs(run_dir: Path) -> list[Path]:
    return sorted(logs_dir(run_dir).glob("rank_*.log"))


def launcher_log(run_dir: Path) -> Path:
    return logs_dir(run_dir) / LAUNCHER_LOG


def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


# --------------------------------------------------------------------------------------------------
# the files the launcher writes and every rank reads


def atomic_write(path: Path, text: str) -> None:
    """Write through a temporary file and rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def config_text(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_config(directory: Path, cfg: RunConfig) -> None:
    atomic_write(Path(directory) / CONFIG_FILE, config_text(cfg))


def read_config(directory: Path) -> RunConfig:
    return RunConfig.model_validate(yaml.safe_load((Path(directory) / CONFIG_FILE).read_text()))


def write_plan(directory: Path, plan: Plan) -> None:
    atomic_write(Path(directory) / PLAN_FILE, json.dumps(plan.to_dict(), indent=2))


def read_plan(directory: Path) -> Plan:
    return Plan.from_dict(json.loads((Path(directory) / PLAN_FILE).read_text()))


def write_run_dir(run_dir: Path, cfg: RunConfig, plan: Plan, argv: list[str]) -> None:
    """The files every rank (and every later tool) reads; each written atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logs_dir(run_dir).mkdir(exist_ok=True)
    write_config(run_dir, cfg)
    write_plan(run_dir, plan)
    atomic_write(run_dir / COMMAND_FILE, shlex.join(["fleetwise", "train", *argv]) + "\n")
    if cfg.data.source == "jsonl":  # built once here, not by every rank from the whole file
        from fleetwise.data.jsonl import write_index

        write_index(run_dir / DATA_INDEX_FILE, cfg.data, getattr(cfg.model, "init_from", None), cfg.model.seq_len)


def write_auto_search(run_dir: Path, search: dict) -> Path:
    """What `strategy=auto` chose and the candidates it weighed (an MLflow artifact of the run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / AUTO_SEARCH_FILE
    atomic_write(path, json.dumps(search, indent=2) + "\n")
    return path


def append_record(run_dir: Path, record: dict) -> None:
    """One optimizer step's metrics (rank 0 only): one JSON line, appended."""
    with metrics_path(run_dir).open("a") as f:
        f.write(json.dumps(record) + "\n")
