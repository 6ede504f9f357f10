"""How dense parameters are updated: the `optim` config group (conf/optim/: adamw, sgd, adagrad),
with the learning-rate schedule and gradient clipping.

The optimizer itself is built inside a rank (runtime/optim.py); the planner counts its state
(config/engine.py `optimizer_state_factor`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetwise.config.base import Section


class OptimConfig(Section):
    name: Literal["sgd", "adamw", "adagrad"] = Field("adamw", description="Optimizer of dense parameters.")
    lr: float = Field(gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled (AdamW) or L2 (SGD) weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW/Adagrad epsilon.")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum.")
    schedule: Literal["constant", "cosine"] = Field("cosine", description="LR schedule after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to lr.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: final lr as a fraction of lr.")
    grad_clip: float | None = Field(1.0, gt=0, description="Max global gradient norm (null: no clipping).")
