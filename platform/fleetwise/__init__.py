"""fleetwise: declarative, config-driven distributed training for PyTorch."""

__version__ = "0.1.0"
