"""Hugging Face weights, the torch half: each rank reads its slices of a model directory's safetensors
(`load_hf_`), `fleetwise.load_model(DIR)` of such a directory (`load_hf_model`), and a model's weights
written back as one (`write_hf_dir`; `runtime/checkpoint.py` `export_hf` reads them from a checkpoint).

Reading: a parameter already sharded (a DTensor: TP, FSDP, both) is read as the box of the global
tensor this rank holds (`compat.local_box`), through safetensors' `get_slice`, which reads those
bytes of the memory-mapped file and nothing else; a whole parameter (DDP, ZeRO-1/2, a pipeline
stage's) is read whole. A routed expert's tensor (Mixtral, Qwen3-MoE: one per expert in the files)
is read into its slice of the stacked experts' weight, by the ranks whose box holds that expert. No rank builds a tensor it does not keep. Values are cast to the parameter's
dtype (bf16 files into fp32 parameters: exact).

Writing: the tensors' names, shapes and dtypes are known up front (a checkpoint's DCP metadata), so each
shard's safetensors header (data offsets included) is written first and the tensors are then read
from the checkpoint and appended one at a time: one tensor in memory, never the model (the experts:
one layer's stacked weight, written out as one tensor per expert).
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import torch
from torch import nn

from fleetwise.compat import local_box
from fleetwise.families.llama.hf import (
    CONFIG,
    INDEX,
    check_weights,
    config_json,
    expected_tensors,
    group_defaults,
    model_values,
    read_hf_config,
    tensor_files,
)
from fleetwise.families.llama.hf_moe import export_architecture
from fleetwise.families.llama.schema import LlamaModel
from fleetwise.models.init import model_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
log = logging.getLogger("fleetwise")
SHARD_BYTES = 2 << 30  # a new shard file after 2 GiB (transformers' own default is 5 GB)


class WeightsError(ValueError):
    """A model directory or checkpoint that cannot be read or written as asked (the message names
    the file and the tensor)."""


@torch.no_grad()
def load_hf_(part: nn.Module, m: LlamaModel) -> None:
    """Fill the materialised part (a model, a pipeline chunk; possibly sharded) from m.init_from."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    sources: dict[str, list[tuple[str, int | None]]] = {}  # parameter -> its tensors (an expert each)
    for hf, (name, _, expert) in expected_tensors(m).items():
        sources.setdefault(name, []).append((hf, expert))
    files, problems = tensor_files(Path(m.init_from))
    if problems:
        raise WeightsError("; ".join(p.msg for p in problems))
    handles: dict[Path, object] = {}

    def handle(hf: str):
        if files[hf] not in handles:
            handles[files[hf]] = safe_open(str(files[hf]), framework="pt", device="cpu")
        return handles[files[hf]]

    read = whole = 0  # bytes read, bytes of the whole tensors they are slices of (in the files' dtype)
    esize = 4
    for raw_name, param in part.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        shape, offset = local_box(param) if isinstance(param, DTensor) else (tuple(param.shape), (0,) * param.dim())
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        for hf, expert in sources[model_name(raw_name)]:
            if expert is None:  # one file tensor: this rank's box of it
                value = handle(hf).get_slice(hf)[box]
                local.copy_(value)
            elif box[0].start <= expert < box[0].stop:  # expert J: slice J of the stacked parameter
                value = handle(hf).get_slice(hf)[box[1:]]
                local[expert - box[0].start].copy_(value)
            else:  # an expert another rank holds
                continue
            read += value.numel() * value.element_size()
            esize = value.element_size()
        whole += param.numel() * esize
    log.info(
        "init_from %s: read %d of the %d bytes of this part's tensors (its slices only)",
        m.init_from,
        read,
        whole,
    )


def load_hf_model(directory: str | Path) -> nn.Module:
    """fleetwise's Llama of a Hugging Face model directory, its weights loaded, on the CPU, in eval
    mode. Raises WeightsError naming what is missing or wrong."""
    from fleetwise.families.llama.model import Llama

    directory = Path(directory).expanduser().resolve()
    cfg, problems = read_hf_config(directory)
    if cfg is None or problems:
        raise WeightsError("; ".join(p.msg for p in problems))
    fields = {**group_defaults(), **model_values(cfg)}
    fields.update(seq_len=cfg.get("max_position_embeddings", 2048), init_from=str(directory))
    m = LlamaModel(**fields)
    problems = check_weights(m)
    if problems:
        raise WeightsError("; ".join(p.msg for p in problems))
    with torch.device("meta"):
        model = Llama(m)
    model.to_empty(device="cpu")
    load_hf_(model, m)
    return model.eval()


def write_hf_dir(
    m: LlamaModel, out: Path, stored: dict[str, tuple[tuple[int, ...], torch.dtype]], read, dtype: str | None = None
) -> list[Path]:
    """Write the model section `m`'s weights as a Hugging Face model directory: config.json,
    model-0000i-of-0000n.safetensors and model.safetensors.index.json. `stored`: fleetwise name ->
    (shape, dtype) of every tensor where they are kept (a checkpoint); `read(name, empty)` fills
    `empty` (of that shape and dtype) with one of them. `dtype`: fp32, bf16 or fp16 (None: as
    stored). Returns the files written."""
    if not isinstance(m, LlamaModel):
        raise WeightsError(
            f"it holds a model of family {m.family!r}: --format hf writes Llama-family models "
            "(export it with --format torch)"
        )
    if m.moe.enabled:
        arch, why = export_architecture(m)
        if arch is None:
            raise WeightsError(
                f"it holds a mixture of experts Hugging Face's Mixtral and Qwen3-MoE cannot express: "
                f"{'; '.join(why)} (export it with --format torch)"
            )
    # (hf name, fleetwise name, shape, dtype written, dtype stored, expert index, stored shape)
    tensors = []
    for hf, (name, shape, expert) in expected_tensors(m).items():
        found = stored.get(name)
        need = shape if expert is None else (m.moe.num_experts, *shape)  # experts: stacked
        if found is None or tuple(found[0]) != need:
            what = "missing" if found is None else f"of shape {list(found[0])}"
            raise WeightsError(f"tensor {name} is {what}; the model needs {list(need)}")
        tensors.append((hf, name, shape, DTYPES[dtype] if dtype else found[1], found[1], expert, need))
    shards = _shards(tensors)
    out.mkdir(parents=True, exist_ok=True)
    written, weight_map, total = [], {}, 0
    stacked: dict[str, torch.Tensor] = {}  # the experts' stacked tensor being written, read once
    for i, shard in enumerate(shards, 1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(path, shard, read, stacked)
        weight_map.update(dict.fromkeys((hf for hf, *_ in shard), path.name))
        written.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    base = None
    if m.init_from is not None and (Path(m.init_from) / CONFIG).is_file():
        base = json.loads((Path(m.init_from) / CONFIG).read_text())
    config = config_json(m, base)
    config["torch_dtype"] = HF_DTYPE_NAMES[tensors[0][3]]
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [*written, out / INDEX, out / CONFIG]


def _shards(tensors: list) -> list[list]:
    """The tensors in order, cut into shards of at most SHARD_BYTES (a bigger tensor alone)."""
    shards: list[list] = [[]]
    size = 0
    for entry in tensors:
        nbytes = _numel(entry[2]) * entry[3].itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_shard(path: Path, shard: list, read, stacked: dict[str, torch.Tensor]) -> int:
    """Header first (every offset is known from the shapes), then each tensor as it is read (an
    expert's: its slice of the stacked tensor, which stays in `stacked` until the next one)."""
    header, offset = {}, 0
    for hf, _, shape, dtype, *_ in shard:
        nbytes = _numel(shape) * dtype.itemsize
        header[hf] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for _, name, shape, dtype, stored, expert, need in shard:
            if expert is None:
                tensor = read(name, torch.empty(shape, dtype=stored))
            else:
                if name not in stacked:
                    stacked.clear()
                    stacked[name] = read(name, torch.empty(need, dtype=stored))
                tensor = stacked[name][expert]
            tensor = tensor.to(dtype).contiguous()
            fh.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return offset
