"""calibrate/registry.py is the one list of measured hardware constants: a constant cannot be
half-added (schema field, registry row, probe, profile key, planner term), and a profile that lacks
one (an old calibrated local.yaml) plans with the registry's default, says so, and takes the
command-line override."""

import dataclasses
import importlib
import re

import pytest
import yaml
from helpers.calibration import MEASURED
from helpers.config import compose
from helpers.repo import REPO

from fleetwise.calibrate.calibration import Calibration
from fleetwise.calibrate.profile import profile, profile_yaml
from fleetwise.calibrate.registry import BY_FIELD, PROBES, ROWS
from fleetwise.config.compose import config_dir
from fleetwise.config.hardware import DESCRIBED, GPU_DEFAULTS, MISSING, HardwareConfig

PACKAGE = REPO / "platform" / "fleetwise"
SCHEMA = list(HardwareConfig.model_fields)


def test_every_schema_field_is_described_or_one_registry_row():
    assert len(BY_FIELD) == len(ROWS), "a constant has two rows"
    assert not set(DESCRIBED) & set(BY_FIELD)
    assert set(SCHEMA) - set(DESCRIBED) == set(BY_FIELD), (
        "schema fields without a row, or rows without a field"
    )


def test_the_schema_defaults_are_the_registry_defaults():
    for row in ROWS:
        assert HardwareConfig.model_fields[row.field].default == row.default, row.field
        assert GPU_DEFAULTS.get(row.field, row.default) == row.gpu_default, row.field
    assert set(GPU_DEFAULTS) <= set(BY_FIELD)


def test_the_key_list_and_every_shipped_profile_define_every_key():
    """conf/hardware_keys.yaml lays every key under the chosen profile (??? until it sets one);
    every conf/hardware option sets them all (STYLE: every option of a group defines every key)."""
    keys = yaml.safe_load((config_dir() / "hardware_keys.yaml").read_text())
    assert list(keys) == SCHEMA and set(keys.values()) == {MISSING}
    for path in sorted((config_dir() / "hardware").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        assert set(data) == set(SCHEMA), f"{path.name}: {set(data) ^ set(SCHEMA)}"


def test_every_row_names_the_probes_that_measure_it():
    for row in ROWS:
        assert row.probes or row.unmeasured, f"{row.field}: no probe and no reason"
        for probe in row.probes:
            module, name = probe.rsplit(".", 1)
            assert callable(getattr(importlib.import_module(f"{PROBES}.{module}"), name, None)), probe
        assert row.unit in ("", "µs", "ns", "GB/s", "×") and row.meaning and row.planner, row.field


def test_every_measurement_is_a_row_or_describes_the_machine():
    """A probe's result lands in a Calibration field: each is a row's (by name, or through the
    writer's MEASURED) or describes the machine; a new measurement without a row fails here."""
    describes = {
        "device_type", "backend", "cores", "peak_flops", "gemm_flops", "single_thread_flops",
        "memory_gib", "notes", "has_bf16", "device_name", "measured_peak_flops", "inter_node_backend",
        "host_to_device_gbps", "device_to_host_gbps",
    }  # fmt: skip
    written_as = {  # Calibration field -> the row the writer fills from it
        "allreduce_latency_us": "comm_latency_us",
        "allreduce_gbps": "intra_node_gbps",
        "gemm_curve": "gemm_efficiency",
        "gemm_curve_one_thread": "gemm_efficiency_one_thread",
    }
    fields = {f.name for f in dataclasses.fields(Calibration)}
    assert fields - describes - set(written_as) <= set(BY_FIELD), (
        fields - describes - set(written_as) - set(BY_FIELD)
    )
    assert set(written_as.values()) <= set(BY_FIELD)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_writer_writes_every_key_the_rows_in_registry_order(device):
    cal = Calibration(**{**MEASURED, "device_type": device})
    written = profile(cal) if device == "cpu" else _gpu_profile(cal)
    assert set(written) == set(SCHEMA)
    assert [k for k in written if k in BY_FIELD] == [row.field for row in ROWS]
    # not measured by this calibration: the registry's default for the device type
    assert written["offload_update_ns_per_param"] == BY_FIELD["offload_update_ns_per_param"].default_for(
        device
    )
    assert written["host_link_gbps"] is None
    assert HardwareConfig.model_validate(written).defaulted == ()


def _gpu_profile(cal):
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "device_count", lambda: 8)
        return profile(cal)


def test_every_constant_is_charged_by_the_planner():
    """plan/ reads `.<field>` (or the HardwareConfig method the row names, which reads the field):
    a constant nothing charges is caught."""
    plan = "\n".join(p.read_text() for p in sorted((PACKAGE / "plan").rglob("*.py")))
    schema = (PACKAGE / "config" / "hardware.py").read_text()
    for row in ROWS:
        assert re.search(rf"\.{row.read_as}\b", plan), f"plan/ never reads hardware.{row.read_as}"
        if row.reads:
            assert re.search(rf"self\.{row.field}\b", schema), f"HardwareConfig never reads {row.field}"


@pytest.fixture
def old_profile(tmp_path, monkeypatch):
    """A hardware/local.yaml written by a calibrate that did not know fsdp_ns_per_param yet."""
    from fleetwise.calibrate import registry

    text = profile_yaml(Calibration(**MEASURED))
    kept = [line for line in text.splitlines(keepends=True) if not line.startswith("fsdp_ns_per_param:")]
    assert len(kept) == len(text.splitlines()) - 1
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "local.yaml").write_text("".join(kept))
    monkeypatch.setenv("FLEETWISE_CONFIG_DIR", str(tmp_path))
    registry._print_once.cache_clear()  # the note is printed once per process
    return tmp_path


FSDP = ("recipe=gpt/tiny", "hardware=local", "strategy=sharding", "strategy.sharding_stage=2")


def test_an_old_profile_plans_with_the_registry_default_and_takes_the_override(old_profile):
    from fleetwise.plan import make_plan

    cfg, problems = compose(*FSDP)
    assert problems == []
    default = BY_FIELD["fsdp_ns_per_param"].default
    assert cfg.hardware.fsdp_ns_per_param == default == 3.0 and cfg.hardware.defaulted == (
        "fsdp_ns_per_param",
    )
    # the override of the key the profile lacks works (it used to be refused as an unknown key)
    given, problems = compose(*FSDP, "hardware.fsdp_ns_per_param=5")
    assert problems == [] and given.hardware.fsdp_ns_per_param == 5 and given.hardware.defaulted == ()
    at_default = make_plan(compose(*FSDP, f"hardware.fsdp_ns_per_param={default}")[0])
    zero = make_plan(compose(*FSDP, "hardware.fsdp_ns_per_param=0")[0])
    assert make_plan(cfg).step_time_s == at_default.step_time_s > zero.step_time_s  # charged, not 0


def test_plan_validate_and_a_sweep_say_once_which_key_took_its_default(old_profile, capsys):
    from fleetwise.cli import main

    note = (
        "note: hardware/local.yaml has no fsdp_ns_per_param (written by an older calibrate): using "
        "the default 3.0 ns; run `fleetwise calibrate` again to measure it"
    )
    assert main(["plan", *FSDP, "--json"]) == 0
    out = capsys.readouterr()
    assert out.err.count(note) == 1 and note not in out.out  # stdout stays JSON
    assert main(["validate", "-m", *FSDP, "train.steps=1,2"]) == 0
    assert note not in capsys.readouterr().err  # said once per process
    old_profile.joinpath("hardware", "local.yaml").write_text(
        old_profile.joinpath("hardware", "local.yaml").read_text() + "fsdp_ns_per_param: 2.5\n"
    )
    from fleetwise.calibrate import registry

    registry._print_once.cache_clear()
    assert main(["validate", *FSDP]) == 0
    assert "note:" not in capsys.readouterr().err


def test_a_gpu_profile_without_a_host_cost_gets_the_gpu_default(tmp_path, monkeypatch):
    """A host cost is 0 on a GPU (calibrate there writes 0): a CPU's default would charge seconds."""
    h100 = yaml.safe_load((config_dir() / "hardware" / "h100.yaml").read_text())
    mine = {k: v for k, v in h100.items() if k not in ("fsdp_ns_per_param", "op_overhead_us")} | {
        "name": "mine"
    }
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "mine.yaml").write_text(yaml.safe_dump(mine))
    monkeypatch.setenv("FLEETWISE_CONFIG_DIR", str(tmp_path))
    cfg, problems = compose("recipe=gpt/gpt3_1.3b", "hardware=mine")
    assert problems == []
    assert set(cfg.hardware.defaulted) == {"fsdp_ns_per_param", "op_overhead_us"}
    assert (cfg.hardware.fsdp_ns_per_param, cfg.hardware.op_overhead_us) == (0.0, 10.0)


def test_a_profile_without_a_described_key_is_still_an_error(tmp_path, monkeypatch):
    """What the machine is has no default: the key list's ??? never reaches the schema as a value."""
    cpu = yaml.safe_load((config_dir() / "hardware" / "cpu.yaml").read_text())
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "bare.yaml").write_text(
        yaml.safe_dump({k: v for k, v in cpu.items() if k != "devices_per_node"})
    )
    monkeypatch.setenv("FLEETWISE_CONFIG_DIR", str(tmp_path))
    _, problems = compose("hardware=bare")
    assert [p.loc for p in problems] == ["hardware.devices_per_node"], problems
