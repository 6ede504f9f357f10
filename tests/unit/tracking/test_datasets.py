"""The training data as an MLflow dataset input: a digest of the content, not of the path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from fleetwise.tracking import datasets


def _cfg(source: str, path) -> SimpleNamespace:
    return SimpleNamespace(
        data=SimpleNamespace(source=source, path=str(path)), model=SimpleNamespace(family="gpt")
    )


def test_token_file_digest_follows_the_content_not_the_path(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "copy" / "b.bin"
    b.parent.mkdir()
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(a)
    tokens.tofile(b)
    da, db = datasets.describe_data(_cfg("token_file", a)), datasets.describe_data(_cfg("token_file", b))
    assert da.digest == db.digest and len(da.digest) == datasets.DIGEST_CHARS
    assert da.name == "a.bin" and da.source_type == "local" and a.resolve().as_uri() in da.source
    tokens[500] += 1  # one token differs
    tokens.tofile(b)
    assert datasets.describe_data(_cfg("token_file", b)).digest != da.digest


def test_image_folder_and_array_digests(tmp_path):
    for root in (tmp_path / "x", tmp_path / "y"):
        for label in ("cat", "dog"):
            (root / label).mkdir(parents=True)
            (root / label / "0.png").write_bytes(label.encode() * 10)
    dx = datasets.describe_data(_cfg("image_folder", tmp_path / "x"))
    assert dx.digest == datasets.describe_data(_cfg("image_folder", tmp_path / "y")).digest
    assert '"files": 2' in dx.profile
    (tmp_path / "y" / "dog" / "0.png").rename(tmp_path / "y" / "cat" / "1.png")  # same bytes, other label
    assert datasets.describe_data(_cfg("image_folder", tmp_path / "y")).digest != dx.digest

    arr = tmp_path / "images.npz"
    np.savez(arr, images=np.zeros((4, 8, 8, 3), np.uint8), labels=np.arange(4))
    first = datasets.describe_data(_cfg("image_array", arr))
    np.savez(arr, images=np.zeros((4, 8, 8, 3), np.uint8), labels=np.arange(4)[::-1])
    assert datasets.describe_data(_cfg("image_array", arr)).digest != first.digest


def test_files_above_the_limit_are_sampled(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "FULL_HASH_BYTES", 1024)
    monkeypatch.setattr(datasets, "WINDOW_BYTES", 64)
    path = tmp_path / "big.bin"
    data = bytearray(8192)
    path.write_bytes(data)
    info = datasets.describe_data(_cfg("token_file", path))
    assert '"sampled": true' in info.profile
    data[0] = 1  # inside the first window
    path.write_bytes(data)
    assert datasets.describe_data(_cfg("token_file", path)).digest != info.digest


def test_your_own_dataset_is_named_by_its_target_and_arguments():
    """data=custom (a Dataset of the user's): named by its target, digested over it and its
    arguments (it has no path; describing it used to stop the MLflow run)."""

    def cfg(n):
        data = SimpleNamespace(source="custom", path=None, dataset={"_target_": "mynet.data.Blobs", "n": n})
        return SimpleNamespace(data=data, model=SimpleNamespace(family="custom"))

    a = datasets.describe_data(cfg(1024))
    assert a.name == "Blobs" and a.source_type == "code" and "mynet.data.Blobs" in a.source
    assert a.digest == datasets.describe_data(cfg(1024)).digest != datasets.describe_data(cfg(512)).digest
