"""Which hardware profile a GPU is, by the name CUDA gives it, and where its variant differs from
that profile's datasheet figures.

`torch.cuda.get_device_name()` names the part ("NVIDIA H100 80GB HBM3" is the SXM5 board, "NVIDIA
H100 PCIe" and "NVIDIA H100 NVL" are the PCIe cards, "NVIDIA H200" the SXM board). The shipped
profiles (conf/hardware/*.yaml) describe the SXM boards of a DGX node; a PCIe card of the same
chip runs at a lower clock and power (a lower peak), and some have other memory. Planning a PCIe
H100 against the SXM profile reads MFU 1.3x too high, so each variant carries the keys where its
datasheet differs: peak FLOP/s (dense, without sparsity), memory, the HBM-bound per-element costs
(18 and 12 bytes per element over the HBM bandwidth, as the profiles derive them) and, for cards
without NVSwitch, the link between the GPUs of a node (PCIe x16 per direction).

Sources: NVIDIA H100 Tensor Core GPU datasheet (2023: SXM5, PCIe, NVL), H200 datasheet (2024: SXM,
NVL), A100 datasheet (2021), V100 datasheet (2020); the sparse rates halved to dense.

Used by `fleetwise calibrate` (a GPU's profile keeps its datasheet peak: the efficiency curve is
measured against it) and by scripts/bench_gpu.py and scripts/gpu_check.py (the profile to plan
a visible GPU with). Nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fleetwise.config.paths import config_dir

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class KnownGPU:
    """One GPU part: a pattern of its CUDA name, the profile it is planned with, and the profile
    keys (dotted, as Hydra overrides name them) where its datasheet differs from that profile's."""

    pattern: str  # regular expression, searched in the CUDA device name
    profile: str  # conf/hardware/<profile>.yaml
    variant: str  # what the part is, in words
    differs: dict[str, Any] = field(default_factory=dict)

    def overrides(self) -> list[str]:
        """The Hydra overrides that plan this part with its profile: `hardware=<profile>` and the
        keys where it differs."""
        return [f"hardware={self.profile}", *(f"hardware.{k}={v}" for k, v in self.differs.items())]


def _pcie(fp32: float, tf32: float, half: float, memory: float, hbm_tbs: float, link_gbps: float) -> dict:
    """The keys a PCIe/NVL card changes: dense peaks, memory, per-element HBM costs, the link."""
    return {
        "peak_tflops.fp32": fp32,
        "peak_tflops.tf32": tf32,
        "peak_tflops.bf16": half,
        "peak_tflops.fp16": half,
        "memory_per_device_gib": memory,
        "elementwise_ns": round(18 / hbm_tbs / 1e3, 5),
        "grad_accumulate_ns": round(12 / hbm_tbs / 1e3, 5),
        "intra_node_gbps": link_gbps,
    }


# First match wins: the variants before their family's default part. `\b` keeps "GH200" (Grace
# Hopper, other memory) from matching H200.
KNOWN_GPUS: tuple[KnownGPU, ...] = (
    KnownGPU(r"\bH100\b.*\bPCIe\b", "h100", "H100 PCIe 80 GB", _pcie(51, 378, 756.5, 80, 2.0, 64)),
    KnownGPU(r"\bH100 NVL\b", "h100", "H100 NVL 94 GB", _pcie(60, 417.5, 835.5, 94, 3.9, 64)),
    KnownGPU(r"\bH100\b", "h100", "H100 SXM5 80 GB"),
    KnownGPU(r"\bH200 NVL\b", "h200", "H200 NVL 141 GB", _pcie(60, 417.5, 835.5, 141, 4.8, 64)),
    KnownGPU(r"\bH200\b", "h200", "H200 SXM 141 GB"),
    KnownGPU(
        r"\bA100\b.*\b40GB\b",
        "a100",
        "A100 40 GB",
        {"memory_per_device_gib": 40, "elementwise_ns": 0.01158, "grad_accumulate_ns": 0.00772},
    ),
    KnownGPU(r"\bA100\b", "a100", "A100 80 GB"),
    KnownGPU(r"\bV100\b.*\b16GB\b", "v100", "V100 16 GB", {"memory_per_device_gib": 16}),
    KnownGPU(r"\bV100\b", "v100", "V100 32 GB"),
)


def known_gpu(device_name: str) -> KnownGPU | None:
    """The part a CUDA device name is, or None (no profile describes it)."""
    return next((g for g in KNOWN_GPUS if re.search(g.pattern, device_name, re.IGNORECASE)), None)


def datasheet_peaks(gpu: KnownGPU) -> dict[str, float]:
    """FLOP/s by precision from the part's datasheet: its profile's peak_tflops with the part's own
    where it differs (precisions the part has no peak for are left out)."""
    import yaml

    profile = yaml.safe_load((config_dir() / "hardware" / f"{gpu.profile}.yaml").read_text())
    tflops = {p: profile["peak_tflops"].get(p) for p in PRECISIONS}
    tflops |= {p: gpu.differs[f"peak_tflops.{p}"] for p in PRECISIONS if f"peak_tflops.{p}" in gpu.differs}
    return {p: float(v) * 1e12 for p, v in tflops.items() if v}


def reference_peaks(device_name: str, measured: dict[str, float]) -> tuple[dict[str, float], str | None]:
    """The peak FLOP/s a GPU's profile is written with, and a note when it is not the datasheet's.

    The datasheet's, for every precision measured here: MFU and the GEMM efficiency curve are
    fractions of what the part is sold as (989 TF/s bf16 on an H100 SXM), not of the best GEMM one
    run reached (~790: the curve topped at 1.0 and MFU read 1.25x high). An unknown part keeps the
    measured peaks, and the note says so."""
    gpu = known_gpu(device_name)
    sheet = datasheet_peaks(gpu) if gpu else {}
    if not sheet:
        return dict(measured), (
            f"no datasheet peak for {device_name!r} (calibrate/gpus.py): peak_tflops is the best GEMM "
            "measured here, so the efficiency curve tops at 1.0 and MFU against it reads high"
        )
    return {p: sheet.get(p, v) for p, v in measured.items()}, None
