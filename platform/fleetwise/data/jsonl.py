"""data=jsonl: fine-tuning documents (one JSON object a line, config/jsonl.py) tokenized with the
model's own tokenizer (`tokenizer.json`, the `tokenizers` library) and packed into rows of seq_len.

A document's tokens d_0 … d_{n-1} (the tokenizer's special tokens, e.g. Llama 3's
<|begin_of_text|>, then the end-of-sequence token when the tokenizer's directory names one) fill
n-1 slots of a row: inputs d_0 … d_{n-2}, labels d_1 … d_{n-1}, positions 0 … n-2. For
{"prompt", "response"} the prompt is tokenized with the special tokens and the response without
them; a label that is a prompt token is -100 (the loss ignores it: `lm_loss`'s ignore_index), so
only the response is learned. Documents are packed in file order, greedily: one that does not fit
in what is left of a row starts the next, and the rest of the row is padding (its own positions
from 0, labels -100). A document longer than seq_len + 1 tokens is cut there; one left with no
learned token (a prompt that fills the row) is dropped; both are counted in the log line.

The `positions` a batch carries restart at every document: Llama's attention turns q and k by them
and lets a token see only the earlier tokens of its own document (families/llama/model.py,
document_mask). Sample i is packed row i; a rank reads and tokenizes only the lines of the rows it
is given. Which lines those are is the packing index (`JsonlIndex`: line offsets, which documents
each row holds), built from the whole file once, by the launcher, into the run directory
(rundir.py, data_index.npz); a source without it (a dry run, a run directory written elsewhere)
builds it itself. torch is imported only to hand a batch over, so the launcher builds the index
without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fleetwise.config.jsonl import Document, parse_line, read_lines, tokenizer_path

if TYPE_CHECKING:
    import torch

log = logging.getLogger("fleetwise")
IGNORE = -100  # the label the loss skips
INDEX_VERSION = 1  # of the packing rule and the index's layout: an older index is rebuilt


def eos_id(tokenizer_file: Path, tok) -> int | None:
    """The end-of-sequence id the tokenizer's directory names: tokenizer_config.json's eos_token,
    else config.json's eos_token_id (the first, when a list); None when neither does."""
    folder = tokenizer_file.parent
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        eos = json.loads(cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return tok.token_to_id(eos)
    model_cfg = folder / "config.json"
    if model_cfg.is_file():
        eos = json.loads(model_cfg.read_text()).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int):
            return eos
    return None


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    prompt: int  # how many of ids are the prompt's (context only)

    def labels_learned(self) -> int:
        """Labels d_1 … d_{n-1} that are not prompt tokens."""
        return len(self.ids) - max(self.prompt, 1)


class Encoder:
    """Documents -> token ids, cut at `limit` tokens."""

    def __init__(self, tokenizer_file: Path, limit: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_file))
        self.eos = eos_id(tokenizer_file, self.tok)
        self.limit = limit

    def encode(self, docs: list[Document]) -> list[Encoded]:
        paired = [d for d in docs if d.prompt]
        # a plain document gets the special tokens itself; a response continues its prompt, which has them
        plain = iter(
            self.tok.encode_batch([d.response for d in docs if not d.prompt], add_special_tokens=True)
        )
        prompts = iter(self.tok.encode_batch([d.prompt for d in paired], add_special_tokens=True))
        responses = iter(self.tok.encode_batch([d.response for d in paired], add_special_tokens=False))
        out = []
        for d in docs:
            if d.prompt:
                p = next(prompts).ids
                ids = [*p, *next(responses).ids]
            else:
                p, ids = [], list(next(plain).ids)
            if self.eos is not None:
                ids.append(self.eos)
            out.append(Encoded(ids[: self.limit], min(len(p), self.limit)))
        return out


def pack(lengths: np.ndarray, learned: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing in file order. lengths: tokens per document (already cut to seq_len + 1);
    learned: labels per document that count. Returns (docs, row_starts): the documents packed, and
    where each row's run of them starts in `docs` (row r holds docs[row_starts[r]:row_starts[r+1]])."""
    docs, starts, used = [], [], seq_len  # a full "previous row": the first document opens row 0
    for i, (n, k) in enumerate(zip(lengths.tolist(), learned.tolist(), strict=True)):
        if k < 1:
            continue
        if used + n - 1 > seq_len:
            starts.append(len(docs))
            used = 0
        docs.append(i)
        used += n - 1
    starts.append(len(docs))
    return np.asarray(docs, dtype=np.int64), np.asarray(starts, dtype=np.int64)


@dataclass(frozen=True)
class JsonlIndex:
    """Where every line is (byte offsets and sizes) and which documents each packed row holds: what
    a rank needs to read and tokenize only the lines of its rows. Built from the whole file once
    (the launcher: <run_dir>/data_index.npz, rundir.py), valid for one file, tokenizer and seq_len
    (`key`)."""

    key: str
    offsets: np.ndarray
    sizes: np.ndarray
    docs: np.ndarray  # the documents packed, row after row
    row_starts: np.ndarray  # row r holds docs[row_starts[r]:row_starts[r + 1]]
    cut: int  # documents cut at seq_len + 1 tokens
    dropped: int  # documents left with no token to learn

    @classmethod
    def build(cls, path: Path, encoder: Encoder, seq_len: int, key: str) -> JsonlIndex:
        lines = read_lines(path)
        offsets = np.cumsum([0] + [len(x) + 1 for x in lines[:-1]], dtype=np.int64)
        sizes = np.asarray([len(x) for x in lines], dtype=np.int64)
        encoded = encoder.encode([_document(path, i, raw) for i, raw in enumerate(lines)])
        lengths = np.asarray([len(e.ids) for e in encoded], dtype=np.int64)
        learned = np.asarray([e.labels_learned() for e in encoded], dtype=np.int64)
        docs, starts = pack(lengths, learned, seq_len)
        if len(starts) < 2:
            raise ValueError(f"{path}: no document has a token to learn at seq_len={seq_len}")
        cut, dropped = int((lengths == seq_len + 1).sum()), int((learned < 1).sum())
        return cls(key, offsets, sizes, docs, starts, cut, dropped)

    def save(self, out: Path) -> None:
        """Written under another name and renamed into place: a reader sees the whole index or none."""
        tmp = out.with_name(out.name + ".tmp.npz")
        np.savez(tmp, **{k: np.asarray(v) for k, v in self.__dict__.items()})
        tmp.replace(out)

    @classmethod
    def load(cls, path: Path, key: str) -> JsonlIndex | None:
        """The index at `path` when it is this key's, else None."""
        if not path.is_file():
            return None
        with np.load(path) as f:
            if str(f["key"]) != key:
                return None
            return cls(**{k: (f[k] if f[k].ndim else f[k].item()) for k in f.files})


def index_key(path: Path, tokenizer_file: Path, seq_len: int) -> str:
    """What an index is valid for: the file (path, size, modification time), the tokenizer's bytes
    and the files beside it that name the end-of-sequence token, seq_len."""
    h = hashlib.sha256()
    stat = path.stat()
    h.update(
        json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, seq_len, INDEX_VERSION]).encode()
    )
    for f in (
        tokenizer_file,
        tokenizer_file.parent / "tokenizer_config.json",
        tokenizer_file.parent / "config.json",
    ):
        h.update(f.read_bytes() if f.is_file() else b"-")
    return h.hexdigest()


def write_index(out: Path, d, init_from: str | None, seq_len: int) -> None:
    """The launcher's side: <run_dir>/data_index.npz, unless the one there is already this data's."""
    path, tokenizer_file = Path(d.path), tokenizer_path(d.tokenizer, init_from)
    key = index_key(path, tokenizer_file, seq_len)
    if JsonlIndex.load(out, key) is None:
        JsonlIndex.build(path, Encoder(tokenizer_file, seq_len + 1), seq_len, key).save(out)


def _document(path: Path, i: int, raw: bytes) -> Document:
    doc = parse_line(raw)
    if isinstance(doc, str):  # validate lists these; a file changed since is refused here
        raise ValueError(f"{path}:{i + 1}: {doc} (run `fleetwise validate` for every bad line)")
    return doc


class PackedJsonl:
    """The sample source of data=jsonl (see the module's docstring). Its index is the launcher's
    (`read_index`, which runtime/modeling.py's build_source calls), or else built here from the
    whole file when first needed."""

    def __init__(self, path: str | Path, tokenizer_file: Path, seq_len: int):
        self.path, self.seq_len = Path(path), seq_len
        self.encoder = Encoder(tokenizer_file, seq_len + 1)
        self.pad = self.encoder.eos if self.encoder.eos is not None else 0
        self.key = index_key(self.path, tokenizer_file, seq_len)
        self._index: JsonlIndex | None = None

    def read_index(self, index_file: Path) -> bool:
        """Take the launcher's index when it is this data's; whether it was."""
        self._index = JsonlIndex.load(index_file, self.key)
        if self._index is not None:
            self._describe(f"read from {index_file}")
        return self._index is not None

    @property
    def index(self) -> JsonlIndex:
        if self._index is None:
            self._index = JsonlIndex.build(self.path, self.encoder, self.seq_len, self.key)
            self._describe("built from the whole file (no launcher's index)")
        return self._index

    @property
    def num_samples(self) -> int:
        return len(self.index.row_starts) - 1

    def _describe(self, how: str) -> None:
        ix = self._index
        log.info(
            "data=jsonl: %d documents -> %d packed rows of %d tokens (%d cut at %d tokens, %d dropped: "
            "no response token left); end-of-sequence id %s; packing index %s",
            len(ix.offsets),
            len(ix.row_starts) - 1,
            self.seq_len,
            ix.cut,
            self.seq_len + 1,
            ix.dropped,
            self.encoder.eos,
            how,
        )

    @classmethod
    def of(cls, d, init_from: str | None, seq_len: int) -> PackedJsonl:
        """The source of a `data` section (data.tokenizer, else model.init_from's tokenizer.json)."""
        return cls(d.path, tokenizer_path(d.tokenizer, init_from), seq_len)

    def _read(self, line_numbers: np.ndarray) -> list[Document]:
        """Only these lines, by their byte offsets."""
        with self.path.open("rb") as f:
            out = []
            for i in line_numbers.tolist():
                f.seek(int(self.index.offsets[i]))
                out.append(_document(self.path, i, f.read(int(self.index.sizes[i]))))
            return out

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        ix = self.index
        rows = np.asarray(indices, dtype=np.int64) % self.num_samples
        n, s = len(rows), self.seq_len
        tokens = np.full((n, s), self.pad, dtype=np.int64)
        labels = np.full((n, s), IGNORE, dtype=np.int64)
        positions = np.zeros((n, s), dtype=np.int64)
        for r, row in enumerate(rows.tolist()):
            docs = ix.docs[ix.row_starts[row] : ix.row_starts[row + 1]]
            at = 0
            for e in self.encoder.encode(self._read(docs)):
                k = len(e.ids) - 1
                tokens[r, at : at + k] = e.ids[:-1]
                labels[r, at : at + k] = e.ids[1:]
                labels[r, at : at + max(e.prompt - 1, 0)] = IGNORE  # targets that are prompt tokens
                positions[r, at : at + k] = np.arange(k)
                at += k
            positions[r, at:] = np.arange(s - at)  # padding: a document of its own, learned nowhere
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "positions": torch.from_numpy(positions),
        }
