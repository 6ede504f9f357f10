"""How a module of the user's model sets its own tensors (families/custom/model.py replays it).

A torch module's `reset_parameters()`; for a Hugging Face model (a transformers PreTrainedModel),
the model's own `_init_weights(module)` for every module -- what transformers does for the
weights it did not load. derive.py refuses a module with tensors and no initializer.
"""

from __future__ import annotations

from typing import Any


def initializer(root: Any):
    """module -> the call that sets that module's own tensors, or None (see the module docstring):
    Hugging Face's `_init_weights(module)` for a transformers model, else `module.reset_parameters`."""
    hf_init = root._init_weights if is_hugging_face(root) else None

    def of(module: Any):
        if hf_init is not None:
            return lambda: hf_init(module)
        reset = getattr(module, "reset_parameters", None)
        return reset if callable(reset) else None

    return of


def is_hugging_face(module: Any) -> bool:
    """A transformers PreTrainedModel (by its class tree: fleetwise does not import transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )
