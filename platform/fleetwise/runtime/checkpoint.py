"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, resume, reshard, export.

What a checkpoint holds: the model (parameters and buffers), the optimizer state, the step (which
is also the data position and the LR schedule's position: data and schedule are functions of the
step), each rank's RNG state, fp16's loss scale, and the resolved config + plan that produced it.

Every rank writes only what it holds (FSDP shards, TP shards, its pipeline stages, its ZeRO-1
partition) under the model's own parameter names -- no DDP/FSDP/activation-checkpoint prefixes,
layers keyed by index -- so a checkpoint loads under any other layout and number of ranks: DCP
reads whatever slices the new layout needs. Only tensors are stored (no pickled Python objects);
the metadata is JSON. DCP's own `.metadata` is a pickle: it is read through an allow-list of
DCP's metadata classes (VerifiedReader), never with plain pickle.

Atomicity: ranks write into `<step_dir>.tmp`; after everyone finished, rank 0 writes
`fleetwise.json` (with every file's size, and a SHA-256 for checkpoints under 1 GiB) and renames
the directory. A directory without `.tmp` and with `fleetwise.json` is complete.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from fleetwise.compat import load_into_empty, metadata_path
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.models.init import model_name
from fleetwise.rundir import CONFIG_FILE, MODEL_DIR, PLAN_FILE
from fleetwise.runtime.checkpoint_files import (
    HASH_LIMIT_BYTES,
    META,
    checkpoint_dir,
    fsync_dir,
    next_seq,
    prune,
    sweep_stale,
    write_durably,
)

RNG_KEY = "rng.rank{rank}"
CUDA_RNG_KEY = "rng_cuda.rank{rank}"


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG streams: the host's, and its GPU's (dropout and random init draw there)."""
    state = {RNG_KEY.format(rank=rank): torch.get_rng_state()}
    if device.type == "cuda":
        state[CUDA_RNG_KEY.format(rank=rank)] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], rank: int, device: torch.device) -> None:
    torch.set_rng_state(state[RNG_KEY.format(rank=rank)])
    cuda_key = CUDA_RNG_KEY.format(rank=rank)
    if device.type == "cuda" and cuda_key in state:
        torch.cuda.set_rng_state(state[cuda_key], device)


SCALE_KEY, GROWTH_KEY = "amp.scale", "amp.growth_tracker"


def scaler_state(scaler) -> dict[str, torch.Tensor]:
    """fp16's GradScaler: its loss scale and the count of overflow-free steps toward the next
    growth (its state_dict; the factors and interval come from the config). Without them a resumed
    job started at 2^16 again and skipped steps backing off to the scale it had. The same on every
    rank (the trainer agrees on overflows), so DCP stores it once."""
    if scaler is None:
        return {}
    state = scaler.state_dict()  # (reads the scale to the host: a checkpoint waits for the device anyway)
    return {
        SCALE_KEY: torch.tensor(state["scale"], dtype=torch.float64),
        GROWTH_KEY: torch.tensor(state["_growth_tracker"], dtype=torch.int64),
    }


def set_scaler_state(scaler, state: dict[str, torch.Tensor]) -> None:
    """Take back what `scaler_state` saved (absent: the checkpoint had none, the scaler starts fresh)."""
    if scaler is None or SCALE_KEY not in state:
        return
    scaler.load_state_dict(
        {**scaler.state_dict(), "scale": float(state[SCALE_KEY]), "_growth_tracker": int(state[GROWTH_KEY])}
    )


class Stateful(Protocol):
    """What a checkpoint saves and restores (the trainer): a flat dict of tensors under
    layout-independent names, loaded in place by DCP and then handed back."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


def model_state(parts) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    return {f"model.{k}": v for k, v in state.items()}


def load_model_state(parts, state: dict[str, torch.Tensor], skip: set[str] = frozenset()) -> None:
    """Each part takes its own entries of a loaded `model.*` state (but those in `skip`, which
    were loaded in place elsewhere: ZeRO-1's masters)."""
    prefix_free = {
        k[len("model.") :]: v for k, v in state.items() if k.startswith("model.") and k not in skip
    }
    for part in parts:
        own = {k for k in get_model_state_dict(part) if k in prefix_free}
        set_model_state_dict(
            part, {k: prefix_free[k] for k in own}, options=StateDictOptions(strict=not skip)
        )


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Optimizer state is created lazily by the first step; make it exist (with lr 0, so parameters
    do not move) so that a checkpoint can be loaded into it in place."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, saved, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


def optimizer_state(parts, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """`state.<param name>.<key>` for the optimizer state this rank holds (the layout-independent
    form of DCP's flattened optimizer state dict; a ZeRO-1 rank holds only its partition). State
    not created yet (before the first step) is created, so that a checkpoint loads into it."""
    out: dict[str, torch.Tensor] = {}
    for part, opt in zip(parts, optimizers, strict=True):
        init_optimizer_state(opt)
        names = {id(p): model_name(n) for n, p in part.named_parameters()}
        for p, st in opt.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[f"state.{names[id(p)]}.{key}"] = value
    return out


def save(run_dir: Path, step: int, app: Stateful, cfg: RunConfig, layout: Layout, *, keep: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        sweep_stale(run_dir)  # this one's, and any a crashed job left
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(app.state_dict(), checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        for name in (CONFIG_FILE, PLAN_FILE):
            shutil.copy2(run_dir / name, tmp / name)
        meta = {
            "step": step,
            "world_size": dist.get_world_size(),
            "mesh": layout.as_dict(),
            "strategy": cfg.strategy.name,
            "recipe": cfg.recipe,
            "model": cfg.model.model_dump(mode="json"),
            "optimizer": cfg.optim.name,
            "saved_at": time.time(),
            "seq": next_seq(run_dir),  # the written order keep-N and resume=auto follow
            "cuda_rng": cfg.hardware.device_type == "cuda",
            "loss_scale": cfg.train.precision == "fp16",
            "files": _manifest(tmp),
        }
        write_durably(tmp / META, json.dumps(meta, indent=2))
        # A checkpoint of this step from an earlier job in this run dir (one resumed from an older
        # step) is superseded: set it aside under a `.tmp` name, which is never resumed from.
        replaced = final.with_name(final.name + ".replaced.tmp")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
        tmp.rename(final)
        fsync_dir(final.parent)  # the rename is on disk before anything older is deleted
        shutil.rmtree(replaced, ignore_errors=True)
        prune(run_dir, keep)
    dist.barrier()
    return final


def save_model(run_dir: Path, parts) -> Path:
    """The final weights alone, as DCP shards in <run_dir>/model (each rank writes what it holds),
    for the launcher to log as an MLflow model when no checkpoint was written. Renamed into place
    when complete, like a checkpoint."""
    final = run_dir / MODEL_DIR
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(model_state(parts), checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


def _manifest(directory: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    out = {}
    for p in files:
        entry: dict[str, Any] = {"size": p.stat().st_size}
        if total <= HASH_LIMIT_BYTES:
            entry["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
        out[str(p.relative_to(directory))] = entry
    return out


def load(path: Path, app: Stateful, cfg: RunConfig) -> None:
    """Load a checkpoint into `app` under its own (possibly different) layout: DCP reads the slices
    this rank's tensors need. RNG streams are per rank, so they are restored only when the number
    of ranks is the same; optimizer state only when the optimizer is."""
    meta = json.loads((path / META).read_text())
    state = app.state_dict()
    if meta["world_size"] != dist.get_world_size():  # RNG streams are per rank: only for the same ranks
        state = {k: v for k, v in state.items() if not k.startswith(("rng.", "rng_cuda."))}
    elif not meta.get("cuda_rng", False):  # written before GPU RNG states were kept (or on CPU)
        state = {k: v for k, v in state.items() if not k.startswith("rng_cuda.")}
    if meta.get("optimizer") != cfg.optim.name:  # a different optimizer starts fresh
        state = {k: v for k, v in state.items() if not k.startswith("state.")}
    if not meta.get("loss_scale", False):  # not fp16 (or written before the scale was kept)
        state = {k: v for k, v in state.items() if k not in (SCALE_KEY, GROWTH_KEY)}
    dcp.load(state, storage_reader=VerifiedReader(path))
    app.load_state_dict(state)


class CheckpointRefused(RuntimeError):
    """A checkpoint's metadata names something a fleetwise checkpoint never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle, and whoever wrote the checkpoint also wrote its sha256
    manifest, so the manifest proves nothing about intent: unpickling someone else's checkpoint
    could run their code. Only the classes DCP's tensor metadata is made of are admitted (no
    BytesStorageMetadata: fleetwise stores tensors only, and DCP loads byte items with
    torch.load(weights_only=False))."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self.ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointRefused(
            f"checkpoint metadata refers to {module}.{name}, which a fleetwise checkpoint never "
            "holds: refused without loading it (a crafted .metadata can run code when unpickled)"
        )


def read_metadata(path: Path) -> Metadata:
    """A checkpoint's DCP metadata through `_MetadataUnpickler`. Called before DCP touches the
    checkpoint: DCP catches a reader's exception and falls back to other metadata files."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or not a pickle at all
        raise CheckpointRefused(f"{path} is not readable DCP metadata ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointRefused(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class VerifiedReader(FileSystemReader):
    """DCP's file reader with the metadata read through `_MetadataUnpickler`."""

    def __init__(self, path: Path):
        read_metadata(Path(path) / ".metadata")  # refuse a crafted checkpoint before DCP reads it
        super().__init__(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(metadata_path(self, kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def export(checkpoint: Path, out: Path) -> Path:
    """Consolidate the model of a sharded checkpoint into one file: {parameter name: tensor}, the
    plain state dict of the fleetwise model (load it with `model.load_state_dict`)."""
    full: dict[str, Any] = {}  # what dcp_to_torch_save does, through the verified reader
    load_into_empty(full, VerifiedReader(checkpoint))
    model = {k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")}
    torch.save(model, out)
    return out


def export_hf(checkpoint: Path, out: Path, dtype: str | None = None, cfg=None) -> list[Path]:
    """A checkpoint of a Llama-family model as a Hugging Face model directory (config.json,
    safetensors shards, index; families/llama/weights.py), streamed: each tensor is read from the
    checkpoint alone (no process group) when its turn comes, so one tensor is in memory at a time.
    cfg: the run's config, for a run's final weights (<run_dir>/model holds none; a checkpoint does).
    Raises WeightsError (a model of another family, a tensor missing or of the wrong shape)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fleetwise.families.llama.weights import WeightsError, write_hf_dir
    from fleetwise.rundir import read_config

    m = (cfg if cfg is not None else read_config(checkpoint)).model
    stored = {
        key[len("model.") :]: (tuple(meta.size), meta.properties.dtype)
        for key, meta in read_metadata(checkpoint / ".metadata").state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }

    def read(name: str, empty: torch.Tensor) -> torch.Tensor:
        dcp.load({f"model.{name}": empty}, storage_reader=VerifiedReader(checkpoint), no_dist=True)
        return empty

    try:
        return write_hf_dir(m, out, stored, read, dtype)
    except WeightsError as exc:
        raise WeightsError(f"{checkpoint}: {exc}") from None
