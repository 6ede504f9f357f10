"""Checks of data files made before any process starts: a missing or malformed file is a config error.

File formats (written by `fleetwise tokenize` or by users):
- token_file: `<name>.bin`, a flat little-endian array of token ids, plus `<name>.json`
  {"dtype": "uint16", "vocab_size": 256, "num_tokens": N}.
- image_array: `.npz` with `images` (N, H, W, C) uint8 and `labels` (N,) integers.
- image_folder: one sub-folder per class holding .png/.jpg/.jpeg files (class index = sorted order).
- jsonl: one {"text": …} or {"prompt": …, "response": …} object per line (config/jsonl.py), and the
  tokenizer.json it is read with.
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


def check_data_file(source: str, path: Path, model: ModelConfig, data=None) -> Iterator[Problem]:
    if not path.exists():
        yield Problem(
            "data.path",
            f"{source} {str(path)!r} does not exist",
            "check data.path (relative paths resolve against the directory you launch from)",
        )
        return
    if source == "jsonl":
        yield from _check_jsonl(path, model, data)
    elif source == "token_file":
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


def _check_jsonl(path: Path, model, data) -> Iterator[Problem]:
    """Every bad line, by number (up to MAX_BAD_LINES, the rest counted), and the tokenizer."""
    from fleetwise.config.jsonl import MAX_BAD_LINES, parse_line, read_lines, tokenizer_path

    fix = 'write one JSON object per line: {"text": "..."} or {"prompt": "...", "response": "..."}'
    if path.is_dir():
        yield Problem("data.path", f"data=jsonl {str(path)!r} is a folder", "point data.path at a .jsonl file")
        return
    lines = read_lines(path)
    if not lines:
        yield Problem("data.path", f"{str(path)!r} has no lines", fix)
    bad = [(i + 1, err) for i, raw in enumerate(lines) if isinstance(err := parse_line(raw), str)]
    for number, err in bad[:MAX_BAD_LINES]:
        yield Problem("data.path", f"{path}:{number}: {err}", fix)
    if len(bad) > MAX_BAD_LINES:
        more = ", ".join(str(n) for n, _ in bad[MAX_BAD_LINES : MAX_BAD_LINES + 10])
        yield Problem(
            "data.path",
            f"{path}: {len(bad) - MAX_BAD_LINES} more bad lines (of {len(bad)} in {len(lines)}), "
            f"from line {more}{', …' if len(bad) > MAX_BAD_LINES + 10 else ''}",
            fix,
        )
    yield from _check_tokenizer(tokenizer_path(data.tokenizer, getattr(model, "init_from", None)), model)


def _check_tokenizer(path: Path | None, model) -> Iterator[Problem]:
    if path is None:
        yield Problem(
            "data.tokenizer",
            "data=jsonl needs a tokenizer: data.tokenizer is null and model.init_from is not set",
            "set data.tokenizer=/path/to/tokenizer.json (or its folder), or model.init_from=<Hugging Face dir>",
        )
        return
    if not path.is_file():
        yield Problem(
            "data.tokenizer",
            f"no tokenizer file {str(path)!r}",
            "point data.tokenizer at a tokenizer.json (the `tokenizers` library's format, as Hugging Face "
            "model folders ship it)",
        )
        return
    from tokenizers import Tokenizer  # local: only data=jsonl configs pay for it

    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported, not raised
        yield Problem("data.tokenizer", f"cannot read {str(path)!r} as a tokenizer.json: {exc}", "check the file")
        return
    if vocab > model.vocab_size:
        yield Problem(
            "model.vocab_size",
            f"the tokenizer {str(path)!r} has {vocab} tokens but model.vocab_size={model.vocab_size}",
            f"set model.vocab_size={vocab} (or more), or use the model's own tokenizer",
        )
