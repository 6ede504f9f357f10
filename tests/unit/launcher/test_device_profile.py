"""`fleetwise train` compares the GPUs it is about to use with the hardware profile (launcher/
preflight.py `device_problem`, `gpu_problem`): a GPT recipe pins hardware=a100, and on H100s it
planned and reported MFU against the A100's 312 TF/s, silently. A mismatch is refused (exit 2,
nothing started) with the setting that fits; the device query (nvidia-smi) is faked here."""

from __future__ import annotations

import os
import stat

import pytest
from helpers.config import compose

from fleetwise import cli
from fleetwise.launcher import preflight

H100 = ("NVIDIA H100 80GB HBM3", 81559 / 1024)  # what the driver reports for an H100 SXM5
H200 = ("NVIDIA H200", 143771 / 1024)
A100_40 = ("NVIDIA A100-SXM4-40GB", 40960 / 1024)


@pytest.fixture
def machine(monkeypatch):
    """Fake this machine's GPUs: set `machine["gpus"]` to a list of (name, GiB)."""
    state = {"gpus": [H100] * 8}
    monkeypatch.setattr(preflight, "visible_gpus", lambda: state["gpus"])
    monkeypatch.setattr(preflight, "gpu_count", lambda: len(state["gpus"]))
    return state


def test_an_h100_machine_refuses_the_a100_profile_with_the_fix(machine, tmp_path, capsys):
    code = cli.main(["train", "recipe=gpt/tiny", "hardware=a100", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "NVIDIA H100 80GB HBM3" in err and "hardware=h100" in err
    assert "memory_per_device_gib" not in err  # 79.6 GiB shown is the profile's 80 GB
    assert not (tmp_path / "run").exists()  # nothing started

    cfg, _ = compose("recipe=gpt/tiny", "hardware=a100")
    problem = preflight.device_problem(cfg, [H100])
    assert problem.loc == "hardware" and problem.hint.startswith("hardware=h100;")
    # the explicit opt-out: the profile under another name is taken as it says
    cfg, _ = compose("recipe=gpt/tiny", "hardware=a100", "hardware.name=a100-as-given")
    assert preflight.device_problem(cfg, [H100]) is None
    assert "hardware.name=a100-as-given" in problem.hint


def test_matching_profiles_pass_and_a_smaller_memory_is_named(machine):
    cfg, _ = compose("recipe=gpt/tiny", "hardware=h100")
    assert preflight.device_problem(cfg, [H100] * 8) is None
    cfg, _ = compose("recipe=gpt/tiny", "hardware=a100")
    problem = preflight.device_problem(cfg, [A100_40])
    assert problem.loc == "hardware.memory_per_device_gib"
    assert problem.hint == "hardware.memory_per_device_gib=40"
    # an ERNIE recipe pins v100: on this A100 the fix names the profile and its memory
    cfg, _ = compose("recipe=ernie/tiny", "hardware=v100")
    assert preflight.device_problem(cfg, [A100_40]).hint.startswith(
        "hardware=a100 hardware.memory_per_device_gib=40;"
    )


def test_an_h200_is_the_h100_profile_with_its_memory(machine):
    """An H200 computes as an H100 SXM (989 TF/s bf16) with 141 GB of HBM3e."""
    cfg, _ = compose("recipe=gpt/tiny", "hardware=h100")
    problem = preflight.device_problem(cfg, [H200])
    assert problem.loc == "hardware.memory_per_device_gib" and problem.hint == "hardware.memory_per_device_gib=140"
    cfg, _ = compose("recipe=gpt/tiny", "hardware=h100", "hardware.memory_per_device_gib=140")
    assert preflight.device_problem(cfg, [H200]) is None
    cfg, _ = compose("recipe=gpt/tiny", "hardware=a100")
    assert preflight.device_problem(cfg, [H200]).hint.startswith(
        "hardware=h100 hardware.memory_per_device_gib=140;"
    )


def test_an_h100_pcie_is_not_the_sxm_profile(machine):
    cfg, _ = compose("recipe=gpt/tiny", "hardware=h100")
    problem = preflight.device_problem(cfg, [("NVIDIA H100 PCIe", 81559 / 1024)])
    assert problem.loc == "hardware" and "fleetwise calibrate" in problem.hint


def test_one_gpu_suggests_its_device_count_not_the_cpu(machine, tmp_path, capsys):
    machine["gpus"] = [H100]
    code = cli.main(["train", "recipe=gpt/tiny", "hardware=h100", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "hardware.devices_per_node=1" in err and "hardware=cpu" not in err
    cfg, _ = compose("recipe=gpt/tiny", "hardware=h100")
    problem = preflight.gpu_problem(cfg, found=1)
    assert problem.loc == "hardware.devices_per_node" and problem.hint.startswith("hardware.devices_per_node=1 ")
    assert preflight.gpu_problem(cfg, found=0).hint.startswith("use hardware=cpu")
    cfg, _ = compose("recipe=gpt/tiny", "hardware=h100", "hardware.devices_per_node=1")
    assert preflight.gpu_problem(cfg, found=1) is None


def test_the_device_query_reads_nvidia_smi_within_cuda_visible_devices(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "echo '0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559'\n"
        "echo '1, GPU-bbbb, NVIDIA A100-SXM4-40GB, 40960'\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert preflight.visible_gpus() == [("NVIDIA H100 80GB HBM3", 81559 / 1024), ("NVIDIA A100-SXM4-40GB", 40.0)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert preflight.visible_gpus() == [("NVIDIA A100-SXM4-40GB", 40.0)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert [n for n, _ in preflight.visible_gpus()] == ["NVIDIA H100 80GB HBM3"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert preflight.visible_gpus() is None
