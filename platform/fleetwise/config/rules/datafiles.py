"""Checks of data files made before any process starts: a missing or malformed file is a config error.

File formats (written by `fleetwise tokenize` or by users):
- token_file: `<name>.bin`, a flat little-endian array of token ids, plus `<name>.json`
  {"dtype": "uint16", "vocab_size": 256, "num_tokens": N}.
- image_array: `.npz` with `images` (N, H, W, C) uint8 and `labels` (N,) integers.
- image_folder: one sub-folder per class holding .png/.jpg/.jpeg files (class index = sorted order).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from fleetwise.config.model import ModelConfig
from fleetwise.config.problems import Problem
from fleetwise.families.resnet.schema import ResNetModel
from fleetwise.families.transformer import TransformerModel

TOKEN_DTYPES = {"uint8": 1, "uint16": 2, "uint32": 4, "int32": 4}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def token_meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def check_data_file(source: str, path: Path, model: ModelConfig) -> Iterator[Problem]:
    if not path.exists():
        yield Problem(
            "data.path",
            f"{source} {str(path)!r} does not exist",
            "check data.path (relative paths resolve against the directory you launch from)",
        )
        return
    if source == "token_file":
        yield from _check_tokens(path, model)
    elif source == "image_array":
        yield from _check_image_array(path, model)
    else:
        yield from _check_image_folder(path, model)


def _check_tokens(path: Path, model: TransformerModel) -> Iterator[Problem]:
    meta_path = token_meta_path(path)
    fix = "write token files with `fleetwise tokenize TEXT… --out FILE.bin`"
    try:
        meta = json.loads(meta_path.read_text())
        dtype, vocab = meta["dtype"], int(meta["vocab_size"])
    except FileNotFoundError:
        yield Problem("data.path", f"token file {str(path)!r} has no metadata file {str(meta_path)!r}", fix)
        return
    except (ValueError, KeyError, TypeError) as exc:
        yield Problem(
            "data.path",
            f"metadata {str(meta_path)!r} is malformed ({exc!r}); it needs dtype and vocab_size",
            fix,
        )
        return
    if dtype not in TOKEN_DTYPES:
        yield Problem(
            "data.path",
            f"token dtype {dtype!r} in {str(meta_path)!r} is not one of {sorted(TOKEN_DTYPES)}",
            fix,
        )
        return
    size = path.stat().st_size
    if size % TOKEN_DTYPES[dtype]:
        yield Problem(
            "data.path",
            f"{str(path)!r} holds {size} bytes, not a whole number of {dtype} tokens (truncated?)",
            fix,
        )
        return
    n = size // TOKEN_DTYPES[dtype]
    if "num_tokens" in meta and int(meta["num_tokens"]) != n:
        yield Problem(
            "data.path",
            f"{str(path)!r} holds {n} tokens but its metadata says {meta['num_tokens']} "
            "(truncated or overwritten?)",
            fix,
        )
    if n < model.seq_len + 1:
        yield Problem(
            "data.path",
            f"{str(path)!r} holds {n} tokens, fewer than one sample (seq_len + 1 = {model.seq_len + 1})",
            "use a larger corpus or a smaller model.seq_len",
        )
    if vocab > model.vocab_size:
        yield Problem(
            "model.vocab_size",
            f"the token file's vocab_size={vocab} exceeds model.vocab_size={model.vocab_size}",
            f"set model.vocab_size={vocab} (or more)",
        )


def _check_image_array(path: Path, model: ResNetModel) -> Iterator[Problem]:
    import numpy as np

    fix = "save with numpy.savez(path, images=uint8 array (N,H,W,C), labels=int array (N,))"
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "images" not in npz or "labels" not in npz:
                yield Problem(
                    "data.path",
                    f"{str(path)!r} lacks 'images' and/or 'labels' arrays (has {sorted(npz.files)})",
                    fix,
                )
                return
            images, labels = npz["images"], npz["labels"]
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported, not raised
        yield Problem("data.path", f"cannot read {str(path)!r} as .npz: {exc}", fix)
        return
    expect = (model.image_size, model.image_size, model.in_channels)
    if images.ndim != 4 or tuple(images.shape[1:]) != expect:
        yield Problem(
            "data.path",
            f"images have shape {tuple(images.shape)}, expected (N, {expect[0]}, {expect[1]}, {expect[2]})",
            "resize the images or set model.image_size/in_channels",
        )
    if labels.shape != (images.shape[0],):
        yield Problem(
            "data.path", f"labels shape {labels.shape} does not match {images.shape[0]} images", fix
        )
    elif labels.size and (labels.min() < 0 or labels.max() >= model.num_classes):
        yield Problem(
            "model.num_classes",
            f"labels span {labels.min()}..{labels.max()} but num_classes={model.num_classes}",
            f"set model.num_classes={int(labels.max()) + 1}",
        )


def _check_image_folder(path: Path, model: ResNetModel) -> Iterator[Problem]:
    if not path.is_dir():
        yield Problem(
            "data.path", f"{str(path)!r} is not a folder", "point data.path at a folder of class folders"
        )
        return
    classes = sorted(p for p in path.iterdir() if p.is_dir())
    if not classes:
        yield Problem(
            "data.path", f"{str(path)!r} has no class sub-folders", "put images in <path>/<class>/*.png"
        )
        return
    if len(classes) > model.num_classes:
        yield Problem(
            "model.num_classes",
            f"{len(classes)} class folders but num_classes={model.num_classes}",
            f"set model.num_classes={len(classes)}",
        )
    if not any(f.suffix.lower() in IMAGE_SUFFIXES for c in classes for f in c.iterdir()):
        yield Problem(
            "data.path",
            f"no {'/'.join(IMAGE_SUFFIXES)} files under {str(path)!r}",
            "put images in <path>/<class>/*.png",
        )
