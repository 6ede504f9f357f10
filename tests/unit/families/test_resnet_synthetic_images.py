"""ResNet's synthetic images (families/resnet/data.py `SyntheticImages`): everything random is
drawn once per source, and a batch is a gather and an add on the source's device -- no numpy
generator per sample (~3 ms per 224x224 image on the host, every step, before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetwise.families.resnet.data import SyntheticImages


def source(**kw) -> SyntheticImages:
    args = {"num_classes": 10, "image_size": 16, "channels": 3, "seed": 7, "num_samples": 10**6, **kw}
    return SyntheticImages(**args)


def test_a_batch_draws_no_random_numbers(monkeypatch):
    images = source()

    def refuse(*args, **kwargs):
        raise AssertionError("a random generator was made for a batch")

    monkeypatch.setattr(np.random, "default_rng", refuse)
    monkeypatch.setattr(torch, "randn", refuse)
    batch = images.batch(np.arange(1000, 1064))
    assert batch["images"].shape == (64, 3, 16, 16) and batch["labels"].shape == (64,)


def test_samples_depend_on_seed_and_index_only_on_every_device():
    a, b = source(), source()
    idx = np.arange(5000, 5032)
    whole = a.batch(idx)
    # any slicing of the indices (data-parallel ranks, micro-batches) reads the same samples
    halves = [b.batch(idx[:16]), b.batch(idx[16:])]
    assert torch.equal(whole["images"], torch.cat([h["images"] for h in halves]))
    assert torch.equal(whole["labels"], torch.cat([h["labels"] for h in halves]))
    assert not torch.equal(whole["images"], source(seed=8).batch(idx)["images"])
    # on the device: the same computation there, the labels stay host integers (the trainer
    # copies them from pinned memory)
    on_meta = source().to(torch.device("meta")).batch(idx)
    assert on_meta["images"].is_meta and on_meta["images"].shape == whole["images"].shape
    assert torch.equal(on_meta["labels"], whole["labels"])


def test_a_sample_is_its_class_prototype_plus_standard_noise():
    images = source(num_classes=4)
    batch = images.batch(np.arange(4096))
    labels = batch["labels"]
    assert np.bincount(labels.numpy(), minlength=4) == pytest.approx([1024] * 4, rel=0.1)
    noise = batch["images"] - 0.5 * images.prototypes[labels]
    assert abs(noise.mean().item()) < 0.02 and noise.std().item() == pytest.approx(1.0, abs=0.02)
    # a sample's noise is a window of the bank at a hashed offset: 16x16x3 images in a bank of 4
    # images' worth have 2305 windows, so with 4 classes 1000 samples nearly all differ (ResNet-50's
    # 224x224 images have 451,585 windows, and 1000 classes)
    first = batch["images"][:1000].reshape(1000, -1)
    assert torch.unique(first, dim=0).shape[0] > 900  # 943 (about 1000^2 / (2 * 4 * 2305) pairs alike)
