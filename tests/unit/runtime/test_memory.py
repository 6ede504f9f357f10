"""The live-tensor tracker behind the CPU memory metric (runtime/memory.py)."""

import torch

from fleetwise.runtime.memory import LiveTensorBytes


def test_counts_outputs_once_per_storage_and_frees_them():
    x = torch.zeros(1024)  # 4 KiB, alive before tracking
    with LiveTensorBytes([x]) as t:
        y = x + 1  # +4 KiB
        v = y.view(32, 32)  # a view: no new storage
        del y, v
        z = x * 2  # the freed storage is gone, +4 KiB again
        assert t.current == 8192
    assert t.peak == 8192
    del z


def test_follows_in_place_storage_resizes_like_fsdp_frees_parameters():
    """FSDP2 frees an unsharded parameter with storage.resize_(0) and re-allocates it for the next
    all-gather on the same storage object, outside dispatch: the tracker must see both."""
    p = torch.zeros(1024)
    resize = torch.UntypedStorage.resize_
    with LiveTensorBytes([p]) as t:
        assert torch.UntypedStorage.resize_ is not resize  # followed inside
        p.untyped_storage().resize_(0)
        assert t.current == 0
        q = torch.ones(256) * 2  # 1 KiB while the parameter is freed
        p.untyped_storage().resize_(4096)
        assert t.current == 4096 + 1024
        del q
    assert t.peak == 4096 + 1024
    assert torch.UntypedStorage.resize_ is resize  # restored on exit


def test_a_retained_graph_dies_with_its_last_reference_while_tracked():
    """The tracker's saved-tensors hook must not keep what autograd saves alive: a node's saved
    output (log_softmax's), saved as it is, would hold the node from inside it -- a cycle no
    backward with retain_graph=True (the zero-bubble input-gradient step) ever breaks."""
    x = torch.randn(64, 64, requires_grad=True)
    with LiveTensorBytes([x]) as t:
        loss = (x.log_softmax(-1) * 2).sum()  # log_softmax saves its 16 KiB output
        torch.autograd.grad(loss, x, retain_graph=True)
        loss.detach_()  # what pipelining does once the input gradient is computed
        del loss
        assert t.current == 64 * 64 * 4, t.current  # x only: the graph and its saved output are gone


def test_a_real_run_leaves_out_what_torch_compile_traces_with():
    """torch.compile traces a block with fake tensors, which the saved-tensors hook sees (dispatch
    does not: `ignore_compile_internals`): they are not this rank's memory. Plain tensors and
    parameters (a subclass: the fake check runs for it) are."""
    from fleetwise.compat import FakeTensorMode

    fake = FakeTensorMode().from_tensor(torch.zeros(1024))
    with LiveTensorBytes([]) as t:
        t._saved(fake)
        assert t.current == 0
        real, param = torch.zeros(1024), torch.nn.Parameter(torch.zeros(256))
        t._saved(real)
        t._saved(param)
        assert t.current == 4096 + 1024
