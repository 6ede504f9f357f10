"""Hugging Face model directories, the torch-free half: `config.json` <-> the `model` section, and the
safetensors files' tensor names, shapes and dtypes (read from their JSON headers, not their data).

`model.init_from=DIR` fills the model section from DIR/config.json before it is parsed (`prefill`): a
field still at the `model` group's default takes config.json's value; a field set to something else
(by a recipe or an override) that disagrees with config.json is a problem naming both. Then the
weights are checked against the parsed section (`check_weights`): every tensor the model needs is in
some *.safetensors file (through model.safetensors.index.json when there is one) with the shape the
section implies; what is wrong is listed, file and tensor named, before any process starts. The
ranks read the tensors themselves (`weights.py`: each rank only its slices).

Mixtures of experts (Mixtral, Qwen3-MoE: `hf_moe.py`) fill `model.moe` too, and their experts' one
tensor per expert in the files is one slice of fleetwise's stacked [E, out, in] weights
(`expected_tensors` names the expert index).

A safetensors file is an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from fleetwise.config.paths import config_dir
from fleetwise.config.problems import Problem
from fleetwise.families.llama.hf_moe import (
    MOE_ARCHITECTURES,
    MOE_KEYS,
    SOFT,
    export_architecture,
    moe_architecture,
    moe_block_tensors,
    moe_config_json,
    moe_problems,
    moe_values,
)

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# config.json's `architectures[0]` -> whether the model has Qwen 3's q/k norms (and its model_type);
# the mixtures of experts: hf_moe.py
ARCHITECTURES = {
    "LlamaForCausalLM": (False, "llama"),
    "Qwen3ForCausalLM": (True, "qwen3"),
    **{arch: (qk, model_type) for arch, (qk, model_type, *_) in MOE_ARCHITECTURES.items()},
}
# Hugging Face's `LlamaConfig` names -> the model section's, with LlamaConfig's defaults for keys a
# config.json may leave out
CONFIG_KEYS = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}
SAFETENSORS_DTYPES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}  # floating dtypes a weight may have
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers older exports wrote; recomputed here
PROBLEM_LIMIT = 12  # weights problems listed one by one; the rest counted


def _problem(what: str, fix: str) -> Problem:
    return Problem("model.init_from", what, fix)


def read_hf_config(directory: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """DIR/config.json as a dict, or the problem that it is missing, unreadable or of a model
    fleetwise does not build."""
    path = directory / CONFIG
    if not path.is_file():
        what = "is not a directory" if not directory.is_dir() else f"has no {CONFIG}"
        return None, [
            _problem(
                f"{directory} {what}: model.init_from needs a Hugging Face model directory "
                f"({CONFIG} and *.safetensors)",
                "point model.init_from at a directory written by save_pretrained (or by `fleetwise "
                "checkpoint export --format hf`)",
            )
        ]
    try:
        cfg = json.loads(path.read_text())
        assert isinstance(cfg, dict)
    except (ValueError, AssertionError, OSError) as exc:
        return None, [_problem(f"{path} is not a JSON object ({exc})", f"repair {path}")]
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        return None, [
            _problem(
                f"{path}: architecture {arch!r} is not one fleetwise builds",
                f"use a model of one of these architectures: {', '.join(ARCHITECTURES)} (or train "
                "from scratch without model.init_from)",
            )
        ]
    problems = []
    unsupported = {
        "hidden_act": (cfg.get("hidden_act", "silu"), "silu"),
        "attention_bias": (cfg.get("attention_bias", False), False),
        "mlp_bias": (cfg.get("mlp_bias", False), False),
    }
    for key, (value, want) in unsupported.items():
        if value != want:
            problems.append(
                _problem(
                    f"{path}: {key}={value!r}; fleetwise's Llama has {key}={want!r}",
                    "use a model without it (Llama 3, Qwen 3)",
                )
            )
    rope_type = _rope(cfg)[1].get("rope_type", "default") if _rope(cfg)[1] else "default"
    if rope_type not in ("default", "llama3"):
        problems.append(
            _problem(
                f"{path}: RoPE scaling {rope_type!r} is not one fleetwise implements",
                "use a model with no RoPE scaling or Llama 3.1's (rope_type llama3)",
            )
        )
    return cfg, problems + moe_problems(cfg, path)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(θ, the scaling dict or None) of a config.json: transformers 5's `rope_parameters`, or the
    older `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return float(theta), None
    return float(theta), dict(scaling)


def model_values(cfg: dict[str, Any]) -> dict[str, Any]:
    """The model section's fields a config.json sets (checked by read_hf_config first)."""
    heads = cfg["num_attention_heads"]
    values = {field: cfg[key] for key, field in CONFIG_KEYS.items() if key in cfg}
    values.setdefault("num_kv_heads", heads)  # LlamaConfig's defaults
    values.setdefault("head_dim", cfg["hidden_size"] // heads)
    values.setdefault("rms_norm_eps", 1e-6)
    values.setdefault("tie_word_embeddings", False)
    theta, scaling = _rope(cfg)
    values["rope_theta"] = theta
    values["rope_scaling"] = None
    if scaling is not None:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        values["rope_scaling"] = {"rope_type": "llama3", **{k: scaling[k] for k in keys if k in scaling}}
    values["qk_norm"] = ARCHITECTURES[cfg["architectures"][0]][0]
    values.update(moe_values(cfg))
    return values


def group_defaults() -> dict[str, Any]:
    """conf/model/llama.yaml: what a field holds when nobody set it."""
    import yaml

    return yaml.safe_load((config_dir() / "model" / "llama.yaml").read_text())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def prefill(raw: dict[str, Any]) -> list[Problem]:
    """Fill the raw model section from model.init_from's config.json, in place (init_from made
    absolute: the ranks may run elsewhere). A field at the group's default takes config.json's value;
    one set to another value that disagrees is a problem naming both."""
    if not raw.get("init_from"):
        return []
    directory = Path(str(raw["init_from"])).expanduser().resolve()
    raw["init_from"] = str(directory)
    cfg, problems = read_hf_config(directory)
    if cfg is None or problems:
        return problems
    defaults = group_defaults()
    values = model_values(cfg)
    moe_values_ = values.pop("moe")
    for field, value in values.items():
        current = raw.get(field)
        if field == "head_dim" and current is None:  # null: the width hidden_size implies
            current = _implied_head_dim(raw)
        if _same(current, value) or _same(raw.get(field), defaults.get(field)):
            raw[field] = value
            continue
        hf_key = next((k for k, f in CONFIG_KEYS.items() if f == field), field)
        problems.append(_disagrees(f"model.{field}", current, directory, hf_key, value))
    raw_moe = raw.get("moe") if isinstance(raw.get("moe"), dict) else {}
    raw["moe"] = raw_moe = dict(raw_moe)
    for field, value in moe_values_.items():
        default = defaults["moe"][field]
        current = raw_moe.get(field, default)
        if field in SOFT:  # a training choice: config.json's value only in place of the default
            if _same(current, default):
                raw_moe[field] = value
            continue
        if field == "expert_ffn_size" and value is None and current == raw.get("intermediate_size"):
            current = None  # Mixtral's experts have the dense width: said explicitly, it agrees
        if _same(current, value) or _same(current, default):
            raw_moe[field] = value
            continue
        problems.append(_disagrees(f"model.moe.{field}", current, directory, MOE_KEYS[field], value))
    return problems


def _disagrees(loc: str, current: Any, directory: Path, hf_key: str, value: Any) -> Problem:
    return Problem(
        loc,
        f"{loc}={current!r} disagrees with {directory / CONFIG}'s {hf_key}={value!r}",
        f"drop the setting of {loc} (model.init_from sets it), or set {loc}={value!r}",
    )


def _implied_head_dim(raw: dict[str, Any]) -> int | None:
    try:
        return raw["hidden_size"] // raw["num_attention_heads"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def expected_tensors(m) -> dict[str, tuple[str, tuple[int, ...], int | None]]:
    """Hugging Face tensor name -> (fleetwise parameter name, shape, expert index) of every weight
    the model section `m` (a LlamaModel) needs. The expert index is None but for a routed expert's
    tensor: slice J of the stacked fleetwise parameter (hf_moe.py)."""
    from fleetwise.families.moe import is_moe_layer

    h, v, f, d = m.hidden_size, m.vocab_size, m.ffn_hidden_size, m.head_width
    q, kv = m.num_attention_heads * d, m.num_kv_heads * d
    block = {
        "input_layernorm.weight": ("ln1.weight", (h,)),
        "self_attn.q_proj.weight": ("attn.wq.weight", (q, h)),
        "self_attn.k_proj.weight": ("attn.wk.weight", (kv, h)),
        "self_attn.v_proj.weight": ("attn.wv.weight", (kv, h)),
        "self_attn.o_proj.weight": ("attn.wo.weight", (h, q)),
        "post_attention_layernorm.weight": ("ln2.weight", (h,)),
    }
    if m.qk_norm:
        block["self_attn.q_norm.weight"] = ("attn.q_norm.weight", (d,))
        block["self_attn.k_norm.weight"] = ("attn.k_norm.weight", (d,))
    mlp = {
        "mlp.gate_proj.weight": ("mlp.gate.weight", (f, h)),
        "mlp.up_proj.weight": ("mlp.up.weight", (f, h)),
        "mlp.down_proj.weight": ("mlp.down.weight", (h, f)),
    }
    arch = moe_architecture(m) if m.moe.enabled else None
    out: dict[str, tuple[str, tuple[int, ...], int | None]] = {
        "model.embed_tokens.weight": ("embed.tok.weight", (v, h), None)
    }
    for i in range(m.num_layers):
        moe_block = arch is not None and is_moe_layer(m.moe, i)
        for hf, (name, shape) in (block | ({} if moe_block else mlp)).items():
            out[f"model.layers.{i}.{hf}"] = (f"layers.{i}.{name}", shape, None)
        if moe_block:
            out.update(moe_block_tensors(m, i, arch))
    out["model.norm.weight"] = ("norm.weight", (h,), None)
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = ("output.weight", (v, h), None)
    return out


def read_header(path: Path) -> dict[str, Any]:
    """Tensor name -> dtype ("BF16", ...) and shape, from a safetensors file's header (safetensors'
    numpy reader opens the header only: no tensor is read, torch is not imported)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return {
            name: {"dtype": (s := f.get_slice(name)).get_dtype(), "shape": s.get_shape()}
            for name in f.keys()  # noqa: SIM118 - safe_open is not iterable
        }


def tensor_files(directory: Path) -> tuple[dict[str, Path], list[Problem]]:
    """Tensor name -> the safetensors file holding it: from the index when there is one, else from
    every *.safetensors file's header."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            return {}, [_problem(f"{index} has no readable weight_map ({exc})", f"repair {index}")]
        files = {name: directory / file for name, file in weight_map.items()}
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            return {}, [
                _problem(
                    f"{index} names {', '.join(missing)}, not in {directory}",
                    "copy the missing shard files into the directory (or download the model again)",
                )
            ]
        return files, []
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        return {}, [
            _problem(
                f"{directory} holds no *.safetensors file",
                "save the model with safe_serialization (transformers' default) or convert its "
                "pytorch_model.bin to safetensors",
            )
        ]
    files: dict[str, Path] = {}
    for shard in shards:
        try:
            files.update(dict.fromkeys(read_header(shard), shard))
        except (SafetensorError, OSError) as exc:
            return {}, [_problem(f"{shard} is not a safetensors file ({exc})", f"replace {shard}")]
    return files, []


def check_weights(m) -> list[Problem]:
    """Every tensor the model section `m` needs is in model.init_from's files, with its shape and a
    floating dtype; every problem (up to PROBLEM_LIMIT, the rest counted) names file and tensor."""
    directory = Path(m.init_from)
    cfg, problems = read_hf_config(directory)
    if cfg is None or problems:
        return []  # prefill said so
    values = m.model_dump()
    values["rope_scaling"] = m.rope_scaling.model_dump() if m.rope_scaling else None
    values["head_dim"] = m.head_width
    want = model_values(cfg)
    moe = {k: v for k, v in want.pop("moe").items() if k not in SOFT}
    if moe.get("expert_ffn_size", 0) is None and values["moe"]["expert_ffn_size"] == m.ffn_hidden_size:
        values["moe"]["expert_ffn_size"] = None  # (Mixtral's: the dense width, said explicitly)
    if not all(_same(values[k], v) for k, v in want.items()) or not all(
        _same(values["moe"][k], v) for k, v in moe.items()
    ):
        return []  # the section disagrees with config.json: prefill named each value, not each tensor
    files, problems = tensor_files(directory)
    if problems:
        return problems
    headers: dict[Path, dict[str, Any]] = {}
    found: list[Problem] = []
    fix = f"use the model directory config.json describes (it says the model of {directory})"
    for hf, (_, shape, _) in expected_tensors(m).items():
        path = files.get(hf)
        if path is None:
            found.append(_problem(f"tensor {hf} is in none of {directory}'s safetensors files", fix))
            continue
        try:
            if path not in headers:
                headers[path] = read_header(path)
            header = headers[path]
        except (SafetensorError, OSError) as exc:
            found.append(_problem(f"{path} is not a safetensors file ({exc})", f"replace {path}"))
            continue
        entry = header.get(hf)
        if entry is None:
            found.append(_problem(f"{path} has no tensor {hf} (the index says it does)", fix))
        elif tuple(entry["shape"]) != shape:
            found.append(
                _problem(
                    f"{path.name}: tensor {hf} has shape {list(entry['shape'])}, the model needs "
                    f"{list(shape)} (from {CONFIG})",
                    fix,
                )
            )
        elif entry["dtype"] not in SAFETENSORS_DTYPES:
            found.append(
                _problem(
                    f"{path.name}: tensor {hf} is {entry['dtype']}; fleetwise reads floating weights "
                    f"({', '.join(SAFETENSORS_DTYPES)})",
                    "use an unquantised model",
                )
            )
    if len(found) > PROBLEM_LIMIT:
        rest = len(found) - PROBLEM_LIMIT
        found = found[:PROBLEM_LIMIT] + [_problem(f"... and {rest} more tensor problems", fix)]
    return found


def config_json(m, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of the model section `m`, over `base` (the config.json it was imported from:
    its token ids and other keys are kept). A mixture of experts is written as Mixtral or Qwen3-MoE
    (hf_moe.export_architecture: the caller has checked that it is one)."""
    qk = m.qk_norm
    arch = next(a for a, (has_qk, _) in ARCHITECTURES.items() if has_qk == qk)
    if m.moe.enabled:
        arch = export_architecture(m)[0]
    dropped = ("rope_scaling", "rope_parameters", "num_experts", "num_local_experts")
    out = {k: v for k, v in (base or {}).items() if k not in dropped}
    out.update(
        architectures=[arch],
        model_type=ARCHITECTURES[arch][1],
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        num_hidden_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_width,
        vocab_size=m.vocab_size,
        intermediate_size=m.ffn_hidden_size,
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        initializer_range=m.init_std,
        rope_theta=m.rope_theta,
        rope_scaling=m.rope_scaling.model_dump() if m.rope_scaling is not None else None,
    )
    if m.moe.enabled:
        out.update(moe_config_json(m, arch))
    out.setdefault("max_position_embeddings", m.seq_len)
    return out
