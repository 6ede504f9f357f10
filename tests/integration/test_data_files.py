"""Real file readers: a tokenised text file for GPT/ERNIE, image arrays and folders for ResNet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import read_metrics, run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
FAST = ("train.steps=3", "tracking.enabled=false", "hardware.devices_per_node=1", "optim.warmup_steps=1")


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    text = tmp / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp / "corpus.bin"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tokenize_text.py"), str(text), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "model.vocab_size=257" in r.stdout
    return out


@pytest.mark.parametrize("recipe", ["gpt/tiny", "ernie/tiny"])
def test_transformers_train_from_a_token_file(tmp_path, token_file, recipe):
    r = run_cli(
        "train",
        f"recipe={recipe}",
        "data=token_file",
        f"data.path={token_file}",
        "model.vocab_size=257",
        *FAST,
        f"run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(read_metrics(tmp_path / "run")) == 3


def test_a_malformed_token_file_is_refused_before_launch(tmp_path, token_file):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(token_file.read_bytes()[:-1])  # odd byte count: truncated uint16
    bad.with_suffix(".json").write_text(token_file.with_suffix(".json").read_text())
    r = run_cli(
        "train",
        "recipe=gpt/tiny",
        "data=token_file",
        f"data.path={bad}",
        "model.vocab_size=257",
        *FAST,
        f"run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "truncated" in r.stderr and not (tmp_path / "run").exists()


def test_resnet_trains_from_an_image_array_and_an_image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(40, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=40)
    np.savez(tmp_path / "images.npz", images=images, labels=labels)
    folder = tmp_path / "folder"
    for c in range(2):
        (folder / f"class{c}").mkdir(parents=True)
        for i in range(8):
            Image.fromarray(images[c * 8 + i]).save(folder / f"class{c}" / f"{i}.png")
    for name, data in (
        ("array", ("data=image_array", f"data.path={tmp_path / 'images.npz'}")),
        ("folder", ("data=image_folder", f"data.path={folder}")),
    ):
        # (the run directory must not be the data folder: a non-empty run.dir is refused)
        run_dir = tmp_path / f"run_{name}"
        r = run_cli("train", "recipe=resnet/tiny", *data, *FAST, f"run.dir={run_dir}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        assert len(read_metrics(run_dir)) == 3
