"""data.source=bundled: real data with no download (the standard library's text, scikit-learn's digits)."""

import numpy as np
import pytest
from helpers.config import compose


def test_bundled_text_is_the_standard_library_as_bytes():
    import sysconfig
    from pathlib import Path

    from fleetwise.data.bundled import BundledText

    src = BundledText(seq_len=32)
    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    assert bytes(src.tokens[: len(first)]) == first
    batch = src.batch(np.arange(8))
    assert batch["tokens"].shape == (8, 32) and int(batch["tokens"].max()) < 256
    assert (batch["tokens"][:, 1:] == batch["labels"][:, :-1]).all()  # next-byte targets
    again = src.batch(np.arange(8))
    assert (again["tokens"] == batch["tokens"]).all()  # a sample is a function of its index
    assert not (src.batch(np.arange(8, 16))["tokens"] == batch["tokens"]).all()


def test_bundled_digits_are_the_scikit_learn_digits():
    from sklearn.datasets import load_digits

    from fleetwise.data.bundled import BundledDigits

    src = BundledDigits(image_size=32, channels=3)
    batch = src.batch(np.arange(64))
    assert batch["images"].shape == (64, 3, 32, 32)
    assert set(batch["labels"].tolist()) <= set(range(10)) and len(set(batch["labels"].tolist())) > 5
    d = load_digits()
    row = int((0 * src._a + src._c) % src.num_samples)  # sample 0's row
    assert int(batch["labels"][0]) == int(d.target[row])
    # enlarged by repeating pixels: the top-left 4×4 block is digit pixel (0, 0)
    assert batch["images"][0, 0, :4, :4].unique().item() == pytest.approx(d.images[row][0, 0] / 8 - 1)


def test_bundled_needs_byte_vocabularies_and_ten_classes():
    cfg, problems = compose("recipe=ernie/tiny")
    assert problems == [] and cfg.data.source == "bundled"
    _, problems = compose("recipe=gpt/tiny", "data=bundled", "model.vocab_size=128")
    assert [p.loc for p in problems] == ["model.vocab_size"]
    _, problems = compose("recipe=resnet/tiny", "model.num_classes=5")
    assert [p.loc for p in problems] == ["model.num_classes"]
    _, problems = compose("recipe=ctr/tiny", "data=bundled")
    assert [p.loc for p in problems] == ["data.source"]
