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
is given (the index of line offsets and token counts is built once, from the whole file).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fleetwise.config.jsonl import Document, parse_line, read_lines, tokenizer_path

log = logging.getLogger("fleetwise")
IGNORE = -100  # the label the loss skips


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


class PackedJsonl:
    """The sample source of data=jsonl (see the module's docstring)."""

    def __init__(self, path: str | Path, tokenizer_file: Path, seq_len: int):
        self.path, self.seq_len = Path(path), seq_len
        self.encoder = Encoder(tokenizer_file, seq_len + 1)
        self.pad = self.encoder.eos if self.encoder.eos is not None else 0
        lines = read_lines(self.path)
        self.offsets = np.cumsum([0] + [len(x) + 1 for x in lines[:-1]], dtype=np.int64)
        self.sizes = np.asarray([len(x) for x in lines], dtype=np.int64)
        encoded = self.encoder.encode([self._document(i, raw) for i, raw in enumerate(lines)])
        lengths = np.asarray([len(e.ids) for e in encoded], dtype=np.int64)
        learned = np.asarray([e.labels_learned() for e in encoded], dtype=np.int64)
        self.docs, self.row_starts = pack(lengths, learned, seq_len)
        self.num_samples = len(self.row_starts) - 1
        if self.num_samples < 1:
            raise ValueError(f"{self.path}: no document has a token to learn at seq_len={seq_len}")
        cut = int((lengths == seq_len + 1).sum())
        log.info(
            "data=jsonl: %d documents -> %d packed rows of %d tokens (%d cut at %d tokens, %d dropped: "
            "no response token left); end-of-sequence id %s",
            len(lines),
            self.num_samples,
            seq_len,
            cut,
            seq_len + 1,
            int((learned < 1).sum()),
            self.encoder.eos,
        )

    @classmethod
    def of(cls, d, init_from: str | None, seq_len: int) -> PackedJsonl:
        """The source of a `data` section (data.tokenizer, else model.init_from's tokenizer.json)."""
        return cls(d.path, tokenizer_path(d.tokenizer, init_from), seq_len)

    def _document(self, i: int, raw: bytes) -> Document:
        doc = parse_line(raw)
        if isinstance(doc, str):  # validate lists these; a file changed since is refused here
            raise ValueError(f"{self.path}:{i + 1}: {doc} (run `fleetwise validate` for every bad line)")
        return doc

    def _read(self, line_numbers: np.ndarray) -> list[Document]:
        """Only these lines, by their byte offsets."""
        with self.path.open("rb") as f:
            out = []
            for i in line_numbers.tolist():
                f.seek(int(self.offsets[i]))
                out.append(self._document(i, f.read(int(self.sizes[i]))))
            return out

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        rows = np.asarray(indices, dtype=np.int64) % self.num_samples
        n, s = len(rows), self.seq_len
        tokens = np.full((n, s), self.pad, dtype=np.int64)
        labels = np.full((n, s), IGNORE, dtype=np.int64)
        positions = np.zeros((n, s), dtype=np.int64)
        for r, row in enumerate(rows.tolist()):
            docs = self.docs[self.row_starts[row] : self.row_starts[row + 1]]
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
