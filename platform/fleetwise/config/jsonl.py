"""The fine-tuning file format of `data=jsonl`, torch-free: what a line must hold and where the
tokenizer comes from. `validate` checks every line with `parse_line` (config/rules/datafiles.py);
the rank's reader (fleetwise.data.jsonl) parses with the same function, so what validate accepts is
exactly what trains.

One JSON object per line, either
    {"text": "..."}                          a document; every token after the first is learned
    {"prompt": "...", "response": "..."}     the prompt's tokens are context only (label -100)
Other keys are ignored (an "id", a source tag). A trailing newline at the end of the file is not a
line; a blank line elsewhere is a bad line (a file cut and pasted together, usually).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
MAX_BAD_LINES = 20  # bad lines listed by validate; the rest are counted


@dataclass(frozen=True)
class Document:
    """One line's text: `prompt` is "" for a plain {"text": ...} document (all of it is learned)."""

    prompt: str
    response: str


def parse_line(raw: bytes) -> Document | str:
    """A line (without its newline) -> its Document, or what is wrong with it."""
    if not raw.strip():
        return "empty line"
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"invalid JSON ({exc})"
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__} value, not an object"
    has_text, has_pair = "text" in obj, "prompt" in obj or "response" in obj
    if has_text and has_pair:
        return 'both "text" and "prompt"/"response": use one form per line'
    if not has_text and not has_pair:
        return f'no "text" nor "prompt"+"response" key (keys: {sorted(obj)[:5]})'
    keys = ("text",) if has_text else ("prompt", "response")
    for key in keys:
        if key not in obj:
            return f'"{key}" is missing'
        if not isinstance(obj[key], str):
            return f'"{key}" is of type {type(obj[key]).__name__}, not a string'
        if not obj[key]:
            return f'"{key}" is empty'
    return Document("", obj["text"]) if has_text else Document(obj["prompt"], obj["response"])


def read_lines(path: Path) -> list[bytes]:
    """The file's lines, without newlines (no trailing empty line for a final newline)."""
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def tokenizer_path(data_tokenizer: str | None, init_from: str | None) -> Path | None:
    """data.tokenizer (a tokenizer.json, or a directory holding one), else model.init_from's
    tokenizer.json; None when neither is set."""
    where = data_tokenizer if data_tokenizer is not None else init_from
    if where is None:
        return None
    path = Path(where)
    return path / TOKENIZER_FILE if path.is_dir() else path
