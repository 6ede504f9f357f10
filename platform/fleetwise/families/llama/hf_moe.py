"""Hugging Face mixtures of experts of the Llama shape, the torch-free half: Mixtral
(`MixtralForCausalLM`, model_type mixtral) and Qwen 3 MoE (`Qwen3MoeForCausalLM`, qwen3_moe) --
config.json <-> `model.moe`, and the experts' tensor names (families/llama/hf.py does the rest, as
for the dense models).

The files on disk (the Hub's, and what transformers 5's save_pretrained writes, checked with
transformers 5.24) keep one tensor per expert, [out, in] as an nn.Linear weight:
  Mixtral:   model.layers.N.block_sparse_moe.gate.weight [E, h],
             model.layers.N.block_sparse_moe.experts.J.{w1, w3, w2}.weight (gate, up, down)
  Qwen3-MoE: model.layers.N.mlp.gate.weight [E, h],
             model.layers.N.mlp.experts.J.{gate_proj, up_proj, down_proj}.weight;
             its dense blocks (mlp_only_layers) are the dense Llama's mlp.{gate,up,down}_proj.
(transformers 5 fuses them in memory -- experts.gate_up_proj [E, 2f, h], experts.down_proj [E, h, f]
-- and splits them again when saving; those fused names are not read here.) fleetwise stacks them:
layers.N.mlp.experts.w1 / w3 [E, f, h], w2 [E, h, f], and the router layers.N.mlp.router.gate.weight:
expert J of a file is slice J of the stacked weight.

Routing is the same computation: softmax over the experts in fp32, the top k, renormalised over
them (Mixtral always; Qwen 3 MoE when norm_topk_prob). What a config.json may say that fleetwise's
layer does not do -- router jitter, sliding-window attention, a pattern of MoE blocks other than
"the first k dense, then every n-th" -- is a problem, all of them listed.
"""

from __future__ import annotations

from typing import Any

from fleetwise.config.problems import Problem

# architecture -> (q/k norms, model_type, the block's MoE module name, the experts' gate/up/down names)
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": (False, "mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": (True, "qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
}
FLEETWISE_EXPERTS = ("w1", "w3", "w2")  # models/moe.py GroupedExperts: gate, up, down
# model.moe fields a config.json fills only while they are at the group's default: training choices
# (the balance loss's weight), not the shape of the weights
SOFT = ("aux_loss_coef", "load_balance")
# model.moe field -> the config.json keys it comes from (for the messages)
MOE_KEYS = {
    "num_experts": "num_local_experts/num_experts (0: a dense model)",
    "top_k": "num_experts_per_tok",
    "num_shared_experts": "shared experts (none)",
    "expert_ffn_size": "moe_intermediate_size (Mixtral: intermediate_size)",
    "first_dense_layers": "mlp_only_layers/decoder_sparse_step",
    "interval": "mlp_only_layers/decoder_sparse_step",
    "score_func": "router scores (softmax)",
    "normalize_weights": "norm_topk_prob (Mixtral: always)",
}


def is_moe(cfg: dict[str, Any]) -> bool:
    return (cfg.get("architectures") or [None])[0] in MOE_ARCHITECTURES


def num_experts(cfg: dict[str, Any]) -> int:
    """The Hub's Qwen3-MoE files say num_experts, transformers 5 writes num_local_experts."""
    return int(cfg.get("num_local_experts", cfg.get("num_experts", 0)))


def hf_moe_layers(cfg: dict[str, Any]) -> list[int]:
    """The blocks with experts, as transformers builds them (Qwen3MoeDecoderLayer: not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0; Mixtral: all)."""
    n = cfg["num_hidden_layers"]
    if cfg["architectures"][0] == "MixtralForCausalLM":
        return list(range(n))
    only, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1) or 1)
    return [i for i in range(n) if i not in only and (i + 1) % step == 0]


def _pattern(layers: list[int], num_layers: int) -> tuple[int, int] | None:
    """(first_dense_layers, interval) whose MoE blocks are exactly `layers`, or None."""
    if not layers:
        return None
    first = layers[0]
    interval = layers[1] - layers[0] if len(layers) > 1 else 1
    if [i for i in range(first, num_layers) if (i - first) % interval == 0] != layers:
        return None
    return first, interval


def moe_problems(cfg: dict[str, Any], path) -> list[Problem]:
    """What fleetwise's MoE layer cannot represent of this config.json (all of it)."""
    if not is_moe(cfg):
        return []
    found = []

    def problem(key: str, what: str, fix: str) -> None:
        found.append(Problem("model.init_from", f"{path}: {key}={cfg.get(key)!r}; {what}", fix))

    if float(cfg.get("router_jitter_noise") or 0.0) != 0.0:
        problem(
            "router_jitter_noise",
            "fleetwise's router does not jitter its inputs",
            f"set router_jitter_noise to 0.0 in {path} (Mixtral's published config has 0.0)",
        )
    if cfg.get("use_sliding_window") or (
        cfg.get("sliding_window") is not None and "use_sliding_window" not in cfg
    ):
        key = "use_sliding_window" if cfg.get("use_sliding_window") else "sliding_window"
        problem(
            key,
            "fleetwise's attention is full causal attention, not a sliding window",
            f"set {key} to {'false' if key == 'use_sliding_window' else 'null'} in {path} (the published "
            "Mixtral 8x7B and Qwen3-30B-A3B configs use none)",
        )
    if num_experts(cfg) < 1:
        problem("num_experts", "a mixture of experts needs experts", "use the model's published config.json")
    elif _pattern(hf_moe_layers(cfg), cfg["num_hidden_layers"]) is None:
        found.append(
            Problem(
                "model.init_from",
                f"{path}: mlp_only_layers={cfg.get('mlp_only_layers')} with decoder_sparse_step="
                f"{cfg.get('decoder_sparse_step', 1)} make blocks {hf_moe_layers(cfg)} MoE blocks; fleetwise "
                "places them as the first model.moe.first_dense_layers blocks dense, then every "
                "model.moe.interval-th",
                "use a model whose MoE blocks follow that pattern (Qwen3-30B-A3B: all of them)",
            )
        )
    return found


def moe_values(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `model.moe` fields (and the dense width) a MoE config.json sets; {"moe": {num_experts:
    0}} for a dense one (a mixture cannot start from dense weights)."""
    if not is_moe(cfg):
        return {"moe": {"num_experts": 0}}
    first, interval = _pattern(hf_moe_layers(cfg), cfg["num_hidden_layers"]) or (0, 1)
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
    coef = float(cfg.get("router_aux_loss_coef", 0.001))
    moe = {
        "num_experts": num_experts(cfg),
        "top_k": cfg.get("num_experts_per_tok", 2),
        "num_shared_experts": 0,
        # Mixtral's experts have the dense width (null: the same); Qwen's their own
        "expert_ffn_size": None if mixtral else cfg["moe_intermediate_size"],
        "first_dense_layers": first,
        "interval": interval,
        "score_func": "softmax",
        "normalize_weights": True if mixtral else bool(cfg.get("norm_topk_prob", False)),
    }
    moe.update({"aux_loss_coef": coef} if coef > 0 else {"load_balance": "none"})
    return {"moe": moe}


def moe_block_tensors(m, layer: int, arch: str) -> dict[str, tuple[str, tuple[int, ...], int | None]]:
    """Hugging Face tensor name -> (fleetwise parameter, shape of the file's tensor, expert index
    into the stacked parameter or None) of MoE block `layer` of the model section `m`."""
    from fleetwise.families.moe import expert_width

    _, _, module, names = MOE_ARCHITECTURES[arch]
    h, e = m.hidden_size, m.moe.num_experts
    f = expert_width(m.moe, m.ffn_hidden_size)
    prefix = f"model.layers.{layer}.{module}"
    out: dict[str, tuple[str, tuple[int, ...], int | None]] = {
        f"{prefix}.gate.weight": (f"layers.{layer}.mlp.router.gate.weight", (e, h), None)
    }
    shapes = ((f, h), (f, h), (h, f))
    for j in range(e):
        for hf, ours, shape in zip(names, FLEETWISE_EXPERTS, shapes, strict=True):
            out[f"{prefix}.experts.{j}.{hf}.weight"] = (f"layers.{layer}.mlp.experts.{ours}", shape, j)
    return out


def moe_architecture(m) -> str:
    """The Hugging Face architecture whose tensor names a MoE model section's weights have: Qwen3-MoE
    with q/k norms, Mixtral without."""
    return "Qwen3MoeForCausalLM" if m.qk_norm else "MixtralForCausalLM"


def export_architecture(m) -> tuple[str | None, list[str]]:
    """(the architecture a MoE model section is written as, what keeps it from being written)."""
    from fleetwise.families.moe import moe_layers

    moe = m.moe
    arch = moe_architecture(m)
    why = []
    if moe.num_shared_experts:
        why.append(
            f"model.moe.num_shared_experts={moe.num_shared_experts} (neither Mixtral nor Qwen3-MoE has "
            "shared experts)"
        )
    if moe.score_func != "softmax":
        why.append(f"model.moe.score_func={moe.score_func} (Mixtral and Qwen3-MoE score with a softmax)")
    if moe.load_balance == "bias":
        why.append(
            "model.moe.load_balance=bias (the balancing bias changes the routing; Hugging Face has none)"
        )
    if arch == "MixtralForCausalLM":
        if len(moe_layers(moe, m.num_layers)) != m.num_layers:
            why.append(
                "dense blocks without q/k norms (Mixtral's blocks are all MoE; Qwen3-MoE has q/k norms)"
            )
        if not moe.normalize_weights:
            why.append("model.moe.normalize_weights=false (Mixtral renormalises the chosen experts' weights)")
    return (None if why else arch), why


def moe_config_json(m, arch: str) -> dict[str, Any]:
    """The config.json keys of the model section `m`'s experts, written as `arch`."""
    from fleetwise.families.moe import expert_width, moe_layers

    moe = m.moe
    f = expert_width(moe, m.ffn_hidden_size)
    out: dict[str, Any] = {
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef if moe.load_balance == "aux_loss" else 0.0,
        "output_router_logits": False,
    }
    if arch == "MixtralForCausalLM":
        return {
            **out,
            "num_local_experts": moe.num_experts,
            "intermediate_size": f,
            "router_jitter_noise": 0.0,
        }
    layers = set(moe_layers(moe, m.num_layers))
    return {
        **out,
        "num_experts": moe.num_experts,  # the Hub's key (transformers 5 reads it too)
        "moe_intermediate_size": f,
        "norm_topk_prob": moe.normalize_weights,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(m.num_layers) if i not in layers],
        "use_sliding_window": False,
    }
