"""ERNIE knowledge masking (Sun et al. 2019): mask whole units instead of single tokens.

- token:       every token is its own unit (BERT's masking);
- whole_word:  all tokens of a word are masked together (basic/phrase-level masking);
- entity_span: runs of 1..max_span_words consecutive words are masked together, standing in for
               the named entities and phrases ERNIE masks (a synthetic corpus has no NER tags).
Units are drawn in a random order until round(seq_len × mask_prob) tokens are selected; a selected
token becomes [MASK] 80% of the time, a random token 10%, and stays 10% (BERT's recipe). Labels
hold the original token at selected positions and -100 elsewhere. [MASK] is the last id of the
model's vocabulary, which the data sources never emit.
"""

from __future__ import annotations

import numpy as np
import torch

from fleetwise.data.tokens import sample_rng

IGNORE = -100


def mask_sequence(
    tokens: np.ndarray,
    words: np.ndarray,
    rng: np.random.Generator,
    *,
    unit: str,
    budget: int,
    max_span_words: int,
    mask_id: int,
    vocab: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Mask one sequence; `words[i]` is the word index of token i (non-decreasing)."""
    if unit == "token":
        units = [np.array([i]) for i in range(len(tokens))]
    else:
        bounds = np.flatnonzero(np.diff(words)) + 1
        word_spans = np.split(np.arange(len(tokens)), bounds)
        if unit == "whole_word":
            units = word_spans
        else:
            units, w = [], 0
            while w < len(word_spans):
                k = int(rng.integers(1, max_span_words + 1))
                units.append(np.concatenate(word_spans[w : w + k]))
                w += k
    selected: list[int] = []
    for u in rng.permutation(len(units)):
        if len(selected) + len(units[u]) <= budget:
            selected.extend(units[u].tolist())
        if len(selected) == budget:
            break
    if not selected:  # every unit is longer than the budget: take the first tokens of one unit
        selected = units[int(rng.integers(len(units)))][:budget].tolist()
    sel = np.array(sorted(selected))
    labels = np.full(len(tokens), IGNORE, dtype=np.int64)
    labels[sel] = tokens[sel]
    out = tokens.copy()
    action = rng.random(len(sel))
    out[sel[action < 0.8]] = mask_id
    rand = sel[(action >= 0.8) & (action < 0.9)]
    out[rand] = rng.integers(vocab - 1, size=len(rand))
    return out, labels


class MaskedLM:
    """Wraps a token source (synthetic or file) into ERNIE's masked-LM batches."""

    def __init__(
        self,
        source,
        *,
        seq_len: int,
        vocab_size: int,
        masking: str,
        mask_prob: float,
        max_span_words: int,
        seed: int,
        space_id: int | None = None,
    ):
        self.source, self.seq_len, self.vocab = source, seq_len, vocab_size
        self.masking, self.max_span_words, self.seed = masking, max_span_words, seed
        self.budget = max(1, round(seq_len * mask_prob))
        self.space_id = space_id
        self.num_samples = source.num_samples
        self.mask_id = vocab_size - 1

    def _words(self, seq: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.space_id is not None:  # real text: a word ends after each space
            return np.concatenate([[0], np.cumsum(seq[:-1] == self.space_id)])
        lengths = rng.integers(1, 4, size=len(seq))  # synthetic words of 1-3 tokens
        return np.repeat(np.arange(len(seq)), lengths)[: len(seq)]

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        seqs = self.source.sequences(indices, self.seq_len)
        toks, labels = np.empty_like(seqs), np.empty_like(seqs)
        for row, idx in enumerate(indices):
            rng = sample_rng(self.seed + 1, idx)  # masking draws differ from the token draws
            words = self._words(seqs[row], rng)
            toks[row], labels[row] = mask_sequence(
                seqs[row],
                words,
                rng,
                unit=self.masking,
                budget=self.budget,
                max_span_words=self.max_span_words,
                mask_id=self.mask_id,
                vocab=self.vocab,
            )
        types = (np.arange(self.seq_len) >= self.seq_len // 2).astype(np.int64)
        return {
            "tokens": torch.from_numpy(toks),
            "token_types": torch.from_numpy(np.broadcast_to(types, toks.shape).copy()),
            "labels": torch.from_numpy(labels),
        }
