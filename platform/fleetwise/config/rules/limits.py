"""Bounds on what a config may ask for, and names and addresses other systems will accept.

Checked before every other rule, so that an absurd value (a 10^11-wide layer, a million pipeline
stages, a 10^13-row table) is a clear error in milliseconds instead of a hang in the planner or a
multi-GiB allocation. The bounds are far above any real job (GPT-3 175B: 96 layers, width 12288,
1,024 GPUs); every accepted config plans in well under 2 s (tests/unit/cli/test_limits.py).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator

from fleetwise.config.problems import Problem, beyond_limit
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.families import family_of

MAX_RANKS = 1 << 20  # ranks of one job (about 1000x the largest published GPU jobs)
# config path -> largest accepted value
MAX = {
    "model.num_layers": 4096,
    "model.hidden_size": 1 << 20,
    "model.ffn_hidden_size": 1 << 22,
    "model.num_attention_heads": 1 << 16,
    "model.vocab_size": 1 << 31,
    "model.seq_len": 1 << 24,
    "model.base_width": 1 << 16,
    "model.image_size": 1 << 16,
    "model.num_classes": 1 << 31,
    "model.in_channels": 1 << 16,
    "model.embedding_dim": 1 << 20,
    "model.num_dense_features": 1 << 20,
    "hardware.nodes": MAX_RANKS,
    "hardware.devices_per_node": 1 << 16,
    "train.global_batch_size": 1 << 24,
    "train.micro_batch_size": 1 << 24,
    "train.accumulate_steps": 1 << 16,
    "train.steps": 10**12,
    "strategy.virtual_stages": 64,
    "strategy.num_servers": 1024,
    "strategy.num_trainers": 1 << 16,
    "launch.collective_timeout_s": 7 * 86400,
    "launch.rdzv_last_call_s": 86400,
    "launch.monitor_interval_s": 3600,
}
# MLflow's own limits (mlflow.utils.validation; runs.name is a 250-character column)
MAX_EXPERIMENT_CHARS, MAX_RUN_NAME_CHARS = 500, 250
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# MAX by section: (key, path, limit) of each. Read through the models' __dict__: a key this section
# does not have (a strategy without virtual_stages) is a miss, not an AttributeError raised through
# pydantic (the auto search runs these bounds for every candidate, thousands per search)
_BY_SECTION: dict[str, list[tuple[str, str, float]]] = {}
for _path, _limit in MAX.items():
    _section, _key = _path.split(".")
    _BY_SECTION.setdefault(_section, []).append((_key, _path, _limit))


MAX_PIPELINE_CHUNKS = 256  # pp_degree × virtual_stages: the planner's schedule cost grows as its square


def layout_problems(cfg: RunConfig, pp: int) -> list[Problem]:
    """Bounds on the resolved layout (pp_degree may have been `auto`)."""
    vs = getattr(cfg.strategy, "virtual_stages", 1) or 1
    if pp * vs <= MAX_PIPELINE_CHUNKS:
        return []
    return [
        Problem(
            "strategy.pp_degree",
            f"pp_degree={pp} × virtual_stages={vs} = {pp * vs} pipeline chunks; fleetwise plans at most "
            f"{MAX_PIPELINE_CHUNKS}",
            "use fewer pipeline stages (and more tensor or data parallelism)",
        )
    ]


def problems(cfg: RunConfig) -> list[Problem]:
    return list(_bounds(cfg)) + list(_names(cfg)) + list(_tags(cfg)) + list(_server_address(cfg))


def _bounds(cfg: RunConfig) -> Iterator[Problem]:
    for section, keys in _BY_SECTION.items():
        values = getattr(getattr(cfg, section, None), "__dict__", {})
        for key, path, limit in keys:
            value = values.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
                yield beyond_limit(path, value, limit)
    hw = cfg.hardware
    ranks = hw.nodes * hw.devices_per_node
    if isinstance(cfg.strategy, PSStrategy):
        ranks = cfg.strategy.num_servers + cfg.strategy.num_trainers
    if ranks > MAX_RANKS:
        yield Problem(
            "hardware",
            f"the job has {ranks:,} ranks (hardware.nodes={hw.nodes:,} × devices_per_node="
            f"{hw.devices_per_node:,}); fleetwise plans at most {MAX_RANKS:,}",
            "use fewer nodes or devices per node",
        )
    yield from family_of(cfg.model).limits(cfg.model)


def _names(cfg: RunConfig) -> Iterator[Problem]:
    """Names MLflow would refuse at run time (then reported as "unreachable") are refused here."""
    checks = [("tracking.experiment", cfg.tracking.experiment, MAX_EXPERIMENT_CHARS)]
    if cfg.run.name is not None:
        checks.append(("run.name", cfg.run.name, MAX_RUN_NAME_CHARS))
    for path, name, limit in checks:
        why = None
        if not name.strip():
            why = "is empty"
        elif len(name) > limit:
            why = f"has {len(name)} characters, MLflow takes at most {limit}"
        elif _CONTROL.search(name):
            why = "contains a control character (newline, tab, …)"
        elif ".." in name.replace("\\", "/").split("/"):
            why = "contains a '..' path segment (MLflow refuses path-like names that escape)"
        if why:
            yield Problem(
                path,
                f"{path}={name[:60]!r}{'…' if len(name) > 60 else ''} {why}",
                f"set {path} to a short plain name",
            )


# MLflow's tag rules: key characters and lengths (mlflow/utils/validation.py)
_TAG_KEY = re.compile(r"^[\w\-. /]+$")
MAX_TAG_KEY_CHARS = 250
MAX_TAG_VALUE_CHARS = 8000


def _tags(cfg: RunConfig) -> Iterator[Problem]:
    for key, value in cfg.tracking.tags.items():
        path = f"tracking.tags.{key}"
        why = None
        if key.startswith(("fleetwise.", "mlflow.")):
            why = "uses a reserved prefix (fleetwise. and mlflow. tags are set by fleetwise and MLflow)"
        elif len(key) > MAX_TAG_KEY_CHARS or not _TAG_KEY.match(key) or ".." in key.split("/"):
            why = f"is not a key MLflow takes (letters, digits, _ - . / and spaces, at most {MAX_TAG_KEY_CHARS})"
        elif len(value) > MAX_TAG_VALUE_CHARS:
            why = f"has a value of {len(value)} characters, MLflow takes at most {MAX_TAG_VALUE_CHARS}"
        if why:
            yield Problem(path, f"tag {key[:60]!r} {why}", "rename the tag, e.g. +tracking.tags.team=nlp")


def _server_address(cfg: RunConfig) -> Iterator[Problem]:
    """strategy.server_address is where TensorPipe RPC listens, and RPC unpickles every call it
    receives: an address others can reach lets them run code in the servers. Loopback unless
    strategy.allow_remote_servers=true (a trusted, private network)."""
    s = cfg.strategy
    if not isinstance(s, PSStrategy):
        return
    if cfg.launch.nnodes != "1" and not s.allow_remote_servers and not _loopback_endpoint(cfg):
        yield Problem(
            "strategy.allow_remote_servers",
            f"strategy=ps across launch.nnodes={cfg.launch.nnodes} nodes: trainers reach servers on "
            "other nodes over the network, and the servers' RPC unpickles what it receives",
            "on a trusted, private network set strategy.allow_remote_servers=true (the RPC then "
            "listens on the interface of the route to launch.rdzv_endpoint)",
        )
    addr = s.server_address.strip()
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        ip = None
        if addr != "localhost" and not _HOSTNAME.fullmatch(addr):
            yield Problem(
                "strategy.server_address",
                f"server_address={s.server_address!r} is neither an IP address nor a host name",
                "set strategy.server_address=127.0.0.1 (one node) or this host's private address",
            )
            return
    loopback = _is_loopback(addr)
    if ip is not None and ip.is_unspecified:
        yield Problem(
            "strategy.server_address",
            f"server_address={addr} listens on every interface: anyone who reaches this host could "
            "send the servers RPC calls, which are unpickled (code execution)",
            "set strategy.server_address=127.0.0.1, or the one private address the trainers use "
            "with strategy.allow_remote_servers=true",
        )
    elif not loopback and not s.allow_remote_servers:
        yield Problem(
            "strategy.server_address",
            f"server_address={addr} is not loopback: the servers' RPC (which unpickles what it "
            "receives) would be reachable from the network",
            "keep 127.0.0.1 for one node; across nodes on a trusted private network set "
            "strategy.allow_remote_servers=true",
        )


def _loopback_endpoint(cfg: RunConfig) -> bool:
    """Every node of the job on this machine (the rendezvous on a loopback address)."""
    return _is_loopback(cfg.launch.rdzv_endpoint.rpartition(":")[0].strip("[]"))


def _is_loopback(host: str) -> bool:
    """`localhost` or a loopback IP address (a host name is not resolved here: no network on the
    validation path)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
