"""Fixtures of the runtime's unit tests."""

import pytest


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A one-rank gloo process group in this process (for code that needs one: DDP, FSDP, the
    checkpoint's collectives), torn down after the test."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
