"""Bytes per element of what the planner counts, by training precision and engine.

Model states are fp32 (4 B) whatever the precision: parameters as stored, gradients as reduced,
optimizer state (ZeRO, Rajbhandari et al. 2020, section 3). What the model computes with -- the
weights FSDP gathers, ZeRO-1's working weights, the matmuls' outputs -- is 16-bit under bf16 or
fp16 (2 B); which activations are depends on how the engine casts (`activation_bytes`).
"""

from __future__ import annotations

from typing import NamedTuple

from fleetwise.config.engine import Engine

FP32 = 4


def compute_bytes(precision: str) -> int:
    """Bytes of an element in the training's compute dtype: 4 under fp32, 2 under bf16 or fp16."""
    return 2 if precision != "fp32" else FP32


class ActivationBytes(NamedTuple):
    matmul: int  # bytes of a matmul's output (the tensor-parallel `split` activations)
    residual: int  # bytes of the residual stream and the norms' inputs (the `whole` activations)


def activation_bytes(precision: str, engine: Engine, convolutional: bool = False) -> ActivationBytes:
    """Autocast computes matmuls in 16 bits but keeps the residual stream in fp32; FSDP's
    MixedPrecisionPolicy casts the parameters instead (no autocast, see the trainer), so everything
    runs in 16 bits. A convolutional network under autocast is 16-bit throughout: BatchNorm is on
    none of autocast's lists, so it keeps its 16-bit input's dtype, and so do ReLU, pooling and the
    residual adds (dry run of ResNet-50 dp 256, fp16: +74% before)."""
    if precision == "fp32":
        return ActivationBytes(FP32, FP32)
    if convolutional:
        return ActivationBytes(2, 2)
    # ZeRO-1's working weights are 16-bit: the embedding's output, and so the residual stream, is too
    return ActivationBytes(2, 2) if engine.casts_weights else ActivationBytes(2, FP32)
