"""fleetwise: declarative, config-driven distributed training for PyTorch."""

__version__ = "0.1.0"


def load_model(path):
    """The model a fleetwise run trained, as an `nn.Module` on the CPU in eval mode.

    `path`: a run directory (its final weights or newest checkpoint) or a checkpoint directory.
    `model = fleetwise.load_model("outputs/…")`; see fleetwise.loading. (torch is imported here,
    not when fleetwise is.)"""
    from fleetwise.loading import load_model as _load_model

    return _load_model(path)
