"""`fleetwise calibrate` on GPUs, without one: what it writes from fixed measurements -- the
datasheet peak and the curve against it, bus bandwidth over the node's GPUs and large buffers,
the pinned host link both ways, the link between nodes over the job's backend, and values kept to
significant figures."""

from __future__ import annotations

import pytest
import yaml
from helpers.calibration import MEASURED

from fleetwise.calibrate.calibration import Calibration
from fleetwise.calibrate.profile import profile, profile_yaml, significant

MIB = 2**20


def _gpu(**fields) -> Calibration:
    return Calibration(**{**MEASURED, "device_type": "cuda", "backend": "nccl", "has_bf16": True, **fields})


def test_measured_values_keep_four_significant_figures():
    # 3-decimal rounding wrote an H100's 0.0054 ns per element as 0.005 (-7 %) and 0.0036 as 0.004
    written = profile(_gpu(elementwise_ns=0.0054, grad_accumulate_ns=0.0036, op_overhead_us=7.31849))
    assert (written["elementwise_ns"], written["grad_accumulate_ns"]) == (0.0054, 0.0036)
    assert written["op_overhead_us"] == 7.318
    assert written["comm_latency_us"] == 200.0 and written["intra_node_gbps"] == 1.5
    assert [significant(v) for v in (0.000123456, 98765.4, 1.0, 0.0)] == [0.0001235, 98770.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("name", "bf16", "fp32"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12, 67e12),
        ("NVIDIA H100 PCIe", 756.5e12, 51e12),
        ("NVIDIA H100 NVL", 835.5e12, 60e12),
        ("NVIDIA H200", 989.4e12, 67e12),
    ],
)
def test_a_known_gpu_keeps_its_datasheet_peak_and_the_curve_is_a_fraction_of_it(name, bf16, fp32):
    """The best GEMM of a run (~790 TF/s bf16 on an H100 SXM) is not the peak MFU is measured
    against: the profile keeps the datasheet's (989.4) and the curve reads 790 / 989.4, not 1.0."""
    from fleetwise.calibrate.gpus import reference_peaks
    from fleetwise.calibrate.probes.gpu import efficiency_curve

    # the best GEMMs of one run: ~80 % of the datasheet (790 of 989.4 TF/s bf16 on an H100 SXM)
    measured = {"fp32": 0.8 * fp32, "tf32": 0.8 * fp32 * 7, "fp16": 0.78 * bf16, "bf16": 0.8 * bf16}
    peak, note = reference_peaks(name, measured)
    assert note is None
    assert (peak["bf16"], peak["fp32"]) == (pytest.approx(bf16), pytest.approx(fp32))
    curve = efficiency_curve({4096: 0.6 * bf16, 8192: 0.8 * bf16, 2048: 0.65 * bf16}, peak["bf16"])
    assert curve[str(2 * 8192**3)] == pytest.approx(0.8)  # not 1.0: the run's best is not the peak
    assert curve[str(2 * 4096**3)] == pytest.approx(0.65)  # made non-decreasing in size
    cal = _gpu(peak_flops=peak, measured_peak_flops=measured, device_name=name, gemm_curve=curve)
    written = profile(cal)
    assert written["peak_tflops"]["bf16"] == pytest.approx(bf16 / 1e12)
    assert written["gemm_efficiency"][-1][1] == 0.8
    header = profile_yaml(cal).split("\nname:")[0]
    assert f"bf16 peak {bf16 / 1e12:.4g} TFLOP/s, best GEMM measured {0.8 * bf16 / 1e12:.4g}" in header


def test_an_unknown_gpu_keeps_the_measured_peak_and_says_so():
    from fleetwise.calibrate.gpus import known_gpu, reference_peaks

    measured = {"fp32": 40e12, "bf16": 300e12}
    peak, note = reference_peaks("NVIDIA GH200 480GB", measured)  # Grace Hopper: no profile of its own
    assert peak == measured and "no datasheet peak for 'NVIDIA GH200 480GB'" in note
    assert known_gpu("NVIDIA GH200 480GB") is None and known_gpu("NVIDIA H200 NVL").profile == "h200"
    text = profile_yaml(_gpu(peak_flops=peak, notes=[note]))
    assert "# note: no datasheet peak" in text


def test_bus_bandwidth_is_nccl_tests_formula_at_the_best_size():
    """8 GPUs, all-reduce: busbw = 2(n-1)/n × bytes / (time - latency); the best of 16, 64 and 256
    MiB counts (small buffers never reach the link's rate); reduce-scatter and all-gather move
    (n-1)/n of the buffer."""
    from fleetwise.calibrate.probes.collectives import bandwidth_sizes, bus_gbps, speeds

    assert bandwidth_sizes("nccl")[-1] >= 256 * MIB and bandwidth_sizes("gloo") == (16 * MIB,)
    assert bus_gbps("all_reduce", 256 * MIB, 1e-3, 8) == pytest.approx(1.75 * 256 * MIB / 1e-3 / 1e9)
    assert bus_gbps("all_gather", 256 * MIB, 1e-3, 8) == pytest.approx(0.875 * 256 * MIB / 1e-3 / 1e9)
    latency = 20e-6
    results = {
        4: latency,
        16 * MIB: 0.25e-3,  # 16 MiB: launch and protocol set-up: 117 GB/s
        64 * MIB: 0.40e-3,
        256 * MIB: 1.20e-3,  # the link's rate: 1.75 × 256 MiB / 1.18 ms = 398 GB/s
        "reduce_scatter": 0.8e-3,
        "all_gather": 0.9e-3,
        "shard_bytes": 256 * MIB,
    }
    got = speeds(results, 8, "nccl")
    assert got["allreduce_latency_us"] == pytest.approx(20.0)
    assert got["allreduce_gbps"] == pytest.approx(1.75 * 256 * MIB / (1.2e-3 - latency) / 1e9)
    assert got["reduce_scatter_gbps"] == pytest.approx(0.875 * 256 * MIB / (0.8e-3 - latency) / 1e9)
    assert got["all_gather_gbps"] == pytest.approx(0.875 * 256 * MIB / (0.9e-3 - latency) / 1e9)
    # gloo (CPU): one 16 MiB buffer between 2 processes, its probes' fields passed on
    gloo = speeds({4: 2e-4, 16 * MIB: 0.03, "reduce_scatter": 0.03, "all_gather": 0.02,
                   "shard_bytes": 16 * MIB, "dtensor_op_us": 400.0}, 2, "gloo")  # fmt: skip
    assert gloo["allreduce_gbps"] == pytest.approx(16 * MIB / (0.03 - 2e-4) / 1e9)
    assert gloo["dtensor_op_us"] == 400.0


def test_the_host_link_is_both_directions():
    from fleetwise.calibrate.probes.gpu import link_rate

    # offload moves parameter shards up and gradient shards down, the same bytes each way
    assert link_rate(50.0, 25.0) == pytest.approx(2 / (1 / 50 + 1 / 25))
    cal = _gpu(host_link_gbps=link_rate(50.0, 25.0), host_to_device_gbps=50.0, device_to_host_gbps=25.0)
    assert profile(cal)["host_link_gbps"] == 33.33
    assert "host->device 50.0 GB/s, device->host 25.0 GB/s" in profile_yaml(cal)


def test_the_link_between_nodes_of_a_gpu_profile_is_not_timed_over_gloo(tmp_path, capsys):
    """--link-only on a machine without CUDA for a profile whose backend is nccl: exit 2 before
    anything is measured, the profile untouched (it used to time gloo over TCP and write that as
    the NCCL rate between nodes); a gloo profile is still measured with gloo."""
    from fleetwise.calibrate.command import link_backend_problem, main

    out = tmp_path / "gpu.yaml"
    text = "name: mine\nbackend: nccl\ninter_node_gbps: 50\n"
    out.write_text(text)
    code = main(["--link-only", "--nodes", "2", "--endpoint", "127.0.0.1:1", "--out", str(out)])
    assert code == 2 and out.read_text() == text
    assert "the profile's backend is nccl" in capsys.readouterr().err
    assert link_backend_problem("gloo", cuda=False) is None
    assert link_backend_problem("nccl", cuda=True) is None
    # the header names the backend that measured the link
    cal = _gpu(inter_node_gbps=21.5, inter_node_latency_us=12.0, inter_node_backend="nccl")
    assert "# between nodes (nccl, one process per node)" in profile_yaml(cal)
    assert yaml.safe_load(profile_yaml(cal))["inter_node_gbps"] == 21.5
