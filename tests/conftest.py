"""Shared fixtures: Dynamo reset and config restore around every test, no unexpected eager
fallback, a world-of-1 gloo process group, and a counting inner compiler."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ddp_split_backend import InnerFallbackWarning
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


@pytest.fixture(autouse=True)
def _no_unexpected_fallback(request) -> Iterator[None]:
    """Fail a test in which a piece fell back to eager unless it expected that: with
    ``pytest.warns``/its own ``catch_warnings`` (which take the warning before it gets here) or
    the ``expects_fallback`` marker (``expects_fallback(condition)``: only where the condition
    holds, e.g. on a torch release that cannot compile the test's region). Other warnings are
    passed on to pytest."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", InnerFallbackWarning)
        yield
    fallbacks = [w for w in caught if issubclass(w.category, InnerFallbackWarning)]
    for w in caught:
        if not issubclass(w.category, InnerFallbackWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    marker = request.node.get_closest_marker("expects_fallback")
    expected = marker is not None and (not marker.args or bool(marker.args[0]))
    if fallbacks and not expected:
        pytest.fail("unexpected eager fallback:\n" + "\n".join(str(w.message)[:1000] for w in fallbacks))


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The ranks' fork server ends with the session that started it (tests/multiproc.py)."""
    from .multiproc import stop_fork_server

    stop_fork_server()
