"""Data sources: deterministic per sample, split the same way whatever the layout; ERNIE masking."""

import numpy as np
import torch

from fleetwise.data.loader import StepBatches
from fleetwise.data.tokens import SyntheticTokens, TokenFile, write_token_file
from fleetwise.families.ernie.data import IGNORE, MaskedLM, mask_sequence


def test_ranks_split_the_global_batch_without_overlap_and_equally():
    src = SyntheticTokens(256, 16, seed=1, num_samples=1000)
    whole = StepBatches(src, 16, 2, 8).indices(3)
    parts = [StepBatches(src, 16, 2, 2, dp_rank=r, dp_size=4).indices(3) for r in range(4)]
    assert np.array_equal(np.concatenate(parts), whole)
    assert {len(p) for p in parts} == {4}
    a = StepBatches(src, 16, 2, 8).whole(3)
    b = torch.cat([StepBatches(src, 16, 2, 2, dp_rank=r, dp_size=4).whole(3)["tokens"] for r in range(4)])
    assert torch.equal(a["tokens"], b)


def test_synthetic_tokens_are_deterministic_and_learnable():
    src = SyntheticTokens(256, 64, seed=7, num_samples=100)
    x, y = src.batch(np.array([5, 6])), src.batch(np.array([5, 6]))
    assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["labels"][:, :-1], x["tokens"][:, 1:])
    seq = x["tokens"][0].numpy()
    follows = np.mean(src.successor[seq[:-1]] == seq[1:])
    assert follows > 0.7  # mostly the fixed successor: a model can learn it


def test_whole_word_masking_masks_words_together_within_budget():
    rng = np.random.default_rng(0)
    tokens = np.arange(40) % 30
    words = np.repeat(np.arange(20), 2)  # every word is 2 tokens
    out, labels = mask_sequence(
        tokens, words, rng, unit="whole_word", budget=6, max_span_words=3, mask_id=99, vocab=100
    )
    sel = np.flatnonzero(labels != IGNORE)
    assert len(sel) == 6
    assert all(((i ^ 1) in sel) for i in sel)  # both tokens of a word, or neither
    assert np.array_equal(labels[sel], tokens[sel])


def test_masked_lm_batches_have_types_labels_and_a_reserved_mask_id():
    base = SyntheticTokens(99, 32, seed=3, num_samples=100)
    mlm = MaskedLM(
        base, seq_len=32, vocab_size=100, masking="entity_span", mask_prob=0.15, max_span_words=3, seed=3
    )
    b = mlm.batch(np.arange(8))
    assert b["tokens"].shape == b["labels"].shape == b["token_types"].shape == (8, 32)
    assert ((b["labels"] != IGNORE).sum(1) <= round(32 * 0.15)).all()
    assert (b["tokens"] == 99).any() and not (base.batch(np.arange(8))["tokens"] == 99).any()


def test_token_file_round_trip(tmp_path):
    tokens = np.arange(1000) % 257
    path = write_token_file(tmp_path / "t.bin", tokens, 257, space_id=32)
    src = TokenFile(path, seq_len=10)
    assert src.num_samples == 99 and src.space_id == 32
    b = src.batch(np.array([0, 3]))
    assert b["tokens"][1].tolist() == list(range(30, 40)) and b["labels"][1].tolist() == list(range(31, 41))


def test_ernie_reads_the_token_file_it_is_given(tmp_path):
    """data=token_file for ERNIE, through what a rank builds (build_source from the config): every
    sample, unmasked again (labels where masked, tokens elsewhere), is the file's own window of
    seq_len tokens at sample × seq_len, read here from the raw bytes. Synthetic data in place of the
    file (data.path ignored) would fail; ERNIE's launch test only checks that 3 steps ran."""
    from fleetwise.config.validate import load_config
    from fleetwise.runtime.modeling import build_source

    rng = np.random.default_rng(11)
    path = write_token_file(tmp_path / "t.bin", rng.integers(0, 250, size=4000), vocab_size=256)
    cfg = load_config(["recipe=ernie/tiny", "data=token_file", f"data.path={path}", "model.vocab_size=257"])
    raw = np.fromfile(path, dtype=np.uint8).astype(np.int64)
    seq_len, samples = cfg.model.seq_len, np.array([0, 3, 17, 40])
    batch = build_source(cfg).batch(samples)
    labels, tokens = batch["labels"].numpy(), batch["tokens"].numpy()
    masked = labels != IGNORE
    assert masked.any() and (tokens[masked] != labels[masked]).any()  # really masked
    original = np.where(masked, labels, tokens)
    for row, i in enumerate(samples):
        assert np.array_equal(original[row], raw[i * seq_len : (i + 1) * seq_len]), i
