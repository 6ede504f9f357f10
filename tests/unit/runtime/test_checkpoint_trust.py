"""A checkpoint someone else wrote cannot run code: DCP's pickled `.metadata` is read through an
allow-list, so a planted payload is refused before anything executes."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fleetwise.cli import main
from fleetwise.runtime.checkpoint import CheckpointRefused, export


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def checkpoint(tmp_path):
    ckpt = tmp_path / "step_00000001"
    state = {"model.w": torch.arange(6.0).reshape(2, 3), "train.step": torch.tensor(1)}
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "fleetwise.json").write_text('{"step": 1, "files": {}}')
    return ckpt


def test_a_genuine_checkpoint_exports(checkpoint, tmp_path):
    out = export(checkpoint, tmp_path / "m.pt")
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(6.0).reshape(2, 3))


def test_a_planted_metadata_payload_is_refused_without_running(checkpoint, tmp_path, capsys):
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointRefused, match="posix.system|os.system"):
        export(checkpoint, tmp_path / "m.pt")
    assert main(["checkpoint", "export", str(checkpoint), "--out", str(tmp_path / "m.pt")]) == 2
    assert "refused" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "m.pt").exists()


def test_metadata_smuggled_inside_genuine_metadata_is_refused(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    meta = pickle.loads((checkpoint / ".metadata").read_bytes())
    meta.planner_data = _Payload(marker)  # a genuine Metadata object carrying a payload
    (checkpoint / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointRefused):
        export(checkpoint, tmp_path / "m.pt")
    assert not marker.exists()
