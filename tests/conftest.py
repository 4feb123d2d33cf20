"""Shared fixtures: Dynamo reset and config restore around every test, a world-of-1 gloo
process group, and a counting inner compiler."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from ddp_split_backend.runtime import GlobalState


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks, so parallel runs do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class CountingCompiler:
    """Inner compiler that records each piece it is given and compiles it with aot_eager."""

    def __init__(self, delegate: str = "aot_eager", fail_on: set[int] | None = None) -> None:
        self.graphs: list[fx.GraphModule] = []
        self.example_inputs: list[list[Any]] = []
        self.delegate = delegate
        self.fail_on = fail_on or set()
        self.__name__ = f"counting[{delegate}]"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        index = len(self.graphs)
        self.graphs.append(gm)
        self.example_inputs.append(list(example_inputs))
        if index in self.fail_on or "all" in self.fail_on:
            raise RuntimeError(f"planned failure on piece {index}")
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.delegate)(gm, example_inputs)

    @property
    def count(self) -> int:
        return len(self.graphs)


@pytest.fixture
def counting() -> CountingCompiler:
    return CountingCompiler()
