"""The dry run's pipeline metadata on torch 2.11 (dryrun/patches.py `route_stage_metadata`): 2.11's
stages send each other tuples of meta tensors, which the relay between simulated ranks compares
(alike middle stages answer for each other: dryrun/fake.py MetaRelay) and a meta tensor's `==`
cannot answer. They travel as specs that compare by value and come back as the same meta tensors.
The route itself runs only on 2.11 (`make test-torch`); the specs run anywhere."""

from __future__ import annotations

import pickle

import pytest
import torch

from fleetwise.dryrun import patches


def test_meta_tensors_travel_as_specs_that_compare_by_value_and_come_back_the_same():
    sent = (torch.empty(2, 8, 16, device="meta"), torch.empty(4, 3, device="meta", dtype=torch.bfloat16).t())
    with pytest.raises(RuntimeError):  # why specs: the relay's comparison of meta tensors has no answer
        bool(sent[0] == sent[0])
    specs = patches._meta_specs(sent)
    again = pickle.loads(pickle.dumps(patches._meta_specs(tuple(t.clone() for t in sent))))
    assert specs == again  # a stage that sends what it received is "alike"
    assert specs != patches._meta_specs((torch.empty(2, 8, 17, device="meta"), sent[1]))
    back = patches._meta_tensors(again)
    assert isinstance(back, tuple) and len(back) == 2
    for a, b in zip(sent, back, strict=True):
        assert (b.device.type, b.shape, b.stride(), b.dtype, b.requires_grad) == (
            "meta",
            a.shape,
            a.stride(),
            a.dtype,
            a.requires_grad,
        )
