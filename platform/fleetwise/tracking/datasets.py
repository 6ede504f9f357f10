"""The job's training data as an MLflow dataset input (`Dataset` + context `training`).

Two runs on the same data show the same name and digest in the UI's "Datasets used" column. The
digest is of the content, not the path: a token file or image array is hashed whole up to
FULL_HASH_BYTES and sampled above it (size + 64 evenly spaced 1 MiB windows, marked `sampled` in
the profile: hashing a 100 GB corpus would hold up the launch for minutes); an image folder hashes
each file's relative path and content; synthetic data is a pure function of its generator and
config, so those are its digest (the seed in the profile and the source).
No torch or mlflow here: the launcher computes this before it imports either.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from fleetwise.families import family_of

DIGEST_CHARS = 32  # MLflow's datasets.digest column holds 36 characters
FULL_HASH_BYTES = 1 << 30
WINDOWS, WINDOW_BYTES = 64, 1 << 20
CONTEXT = "training"


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    digest: str
    source_type: str  # MLflow's: "local" for files, "code" for generated data
    source: str  # JSON, as MLflow's own dataset sources write it
    profile: str  # JSON: sample count, bytes, ...
    schema: str = ""


def _file_digest(path: Path, h) -> bool:
    """Feed `path` into hash `h`; True when sampled rather than read whole."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
            return False
        h.update(str(size).encode())
        for i in range(WINDOWS):
            f.seek(i * (size - WINDOW_BYTES) // (WINDOWS - 1))
            h.update(f.read(WINDOW_BYTES))
        return True


def describe_data(cfg) -> DatasetInfo:
    """What the job trains on (cfg: a validated RunConfig)."""
    d, m = cfg.data, cfg.model
    h = hashlib.sha256()
    profile: dict[str, object] = {}
    if d.source == "synthetic":
        shape = family_of(m).data_profile(m, d)  # what else determines the family's synthetic samples
        spec = {
            "generator": f"fleetwise.synthetic.{m.family}",
            "seed": d.seed,
            "num_samples": d.num_samples,
            **shape,
        }
        h.update(json.dumps(spec, sort_keys=True).encode())
        profile = {"seed": d.seed, "num_samples": d.num_samples}
        name = f"synthetic-{m.family}-seed{d.seed}"
        source_type, source = (
            "code",
            json.dumps({"tags": {"fleetwise.data.generator": spec["generator"]}, **spec}),
        )
    elif d.source == "bundled":
        # the standard library's text (this Python's version) or scikit-learn's digits
        text = getattr(m, "vocab_size", None) is not None  # token models read text, ResNet the digits
        corpus = f"python{sys.version_info[0]}.{sys.version_info[1]}-stdlib-text" if text else "digits"
        spec = {"generator": f"fleetwise.bundled.{corpus}", "family": m.family}
        h.update(json.dumps(spec, sort_keys=True).encode())
        name = f"bundled-{corpus}"
        source_type, source = (
            "code",
            json.dumps({"tags": {"fleetwise.data.generator": spec["generator"]}, **spec}),
        )
    elif d.source == "custom":
        # your own Dataset: named by its target and arguments (its code is the user's)
        spec = {"generator": d.dataset["_target_"], **{k: v for k, v in d.dataset.items() if k != "_target_"}}
        h.update(json.dumps(spec, sort_keys=True, default=str).encode())
        name = d.dataset["_target_"].rsplit(".", 1)[-1]
        source_type, source = (
            "code",
            json.dumps({"tags": {"fleetwise.data.generator": spec["generator"]}, **spec}, default=str),
        )
    else:
        path = Path(d.path).resolve()
        if d.source == "image_folder":
            files = sorted(p for p in path.rglob("*") if p.is_file())
            for f in files:
                h.update(f.relative_to(path).as_posix().encode() + b"\0")
                _file_digest(f, h)
            profile = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
        else:
            profile = {"bytes": path.stat().st_size, "sampled": _file_digest(path, h)}
            meta = path.with_suffix(".json")
            if d.source == "token_file" and meta.exists():
                info = json.loads(meta.read_text())
                profile.update(num_tokens=info.get("num_tokens"), vocab_size=info.get("vocab_size"))
        name = path.name
        source_type, source = "local", json.dumps({"uri": path.as_uri()})
    profile["format"] = d.source
    return DatasetInfo(name, h.hexdigest()[:DIGEST_CHARS], source_type, source, json.dumps(profile))


def log_dataset(mlflow_client, run_id: str, info: DatasetInfo) -> None:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(
        name=info.name,
        digest=info.digest,
        source_type=info.source_type,
        source=info.source,
        schema=info.schema or None,
        profile=info.profile,
    )
    mlflow_client.log_inputs(
        run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", CONTEXT)])]
    )
