"""Zero bubble's weight step reads output gradients that torch captured at the input-gradient
step (torch.distributed.pipelining._backward.stage_backward_input keeps them in each parameter
group's "grads" until stage_backward_weight): the planner counts them per unit
(`Unit.weight_grad_outputs`). Here torch's own captured gradients of a real GPT last stage are
summed, storage by storage, and held against the units."""

import torch
from helpers.config import compose

from fleetwise.compat import stage_backward_split
from fleetwise.families.gpt.model import GPT
from fleetwise.models.transformer import lm_loss
from fleetwise.plan.chunks import units_of


def test_weight_grad_outputs_are_what_torch_keeps_for_the_weight_step():
    cfg, problems = compose("recipe=gpt/tiny", "model.num_layers=2")
    assert problems == []
    m = cfg.model
    torch.manual_seed(0)
    stage = GPT(m)
    stage.embed = None  # the last pipeline stage: hidden states in, logits out
    b = 3
    x = torch.randn(b, m.seq_len, m.hidden_size, requires_grad=True)
    labels = torch.randint(0, m.vocab_size, (b, m.seq_len))
    loss = lm_loss(stage(x), labels)
    _, stage_backward_input, _ = stage_backward_split()
    _, groups = stage_backward_input((loss,), None, [x], stage.parameters())
    kept = {}
    for group in groups:
        for grads in group["grads"]:
            for g in grads:
                if g is not None:
                    kept[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    units = [u for u in units_of(m) if u.kind != "embedding"]
    assert [u.kind for u in units] == ["block", "block", "head"]
    planned = sum(b * u.weight_grad_outputs.elements(1, False) * 4 for u in units)
    s, h, f, v = m.seq_len, m.hidden_size, m.ffn_hidden_size, m.padded_vocab_size
    # by hand: q, k, v, fc1, out-proj, fc2, both norms; the final norm and the logits
    assert planned == b * 4 * (2 * (3 * s * h + s * f + 2 * s * h + 2 * s * h) + s * h + s * v)
    assert sum(kept.values()) == planned
