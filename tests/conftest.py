"""Shared fixtures: Dynamo reset and config restore around every test, a world-of-1 gloo
process group, and a counting inner compiler."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ddp_split_backend.guards import GlobalState

from .helpers import CountingCompiler, free_port


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Reset Dynamo, restore every torch config a test changes, check global state is intact."""
    torch._dynamo.reset()
    dynamo_config = torch._dynamo.config.save_config()
    inductor_config = torch._inductor.config.save_config()
    before = GlobalState.capture()
    try:
        yield
    finally:
        torch._dynamo.config.load_config(dynamo_config)
        torch._inductor.config.load_config(inductor_config)
        torch._dynamo.reset()
        after = GlobalState.capture()
        before.restore()
        assert after == before, f"test left global state changed: {after} != {before}"


@pytest.fixture(scope="session")
def world1() -> Iterator[None]:
    """A gloo process group of one rank, so DDP can wrap models in this process."""
    if dist.is_initialized():
        yield
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def counting() -> CountingCompiler:
    return CountingCompiler()
