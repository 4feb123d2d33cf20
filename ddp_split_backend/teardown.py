"""End a DDP run without the gloo teardown deadlock (see "Ending a DDP run" in docs/launchers.md).

Note [Teardown deadlock]
------------------------
torch 2.13 stashes a ``contextvars.Context`` in C++ thread-local storage for the duration of
every ``backward()`` (``torch.autograd.graph._engine_run_backward``). Every gloo collective
DDP's reducer launches during backward captures the thread-local state, Context included,
and the reducer keeps only the collective's future: the gloo worker thread holds the last
reference to the work and must take the GIL to release that Context. DDP's ``Reducer``
owns its process group; when the reducer is destroyed last (the DDP module going away after
``destroy_process_group()``, or at interpreter exit), the gloo group's destructor joins its
worker threads *while holding the GIL* (the reducer's Python binding does not release it),
and a worker still releasing a work waits for the GIL forever. Eager DDP and torch's
DDPOptimizer launch their collectives the same way; ddp_split adds nothing to that state.

Python's own process-group objects release the GIL when they are destroyed. So the order
that cannot deadlock is: let go of every reducer while the process group is still alive
(its destruction is then only a reference drop), and only then destroy the group.
:func:`close_ddp` does exactly that.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


from . import _torch

__all__ = ["close_ddp"]

_REDUCER_OWNERS = ("reducer", "logger")
"""DDP attributes that own the C++ reducer (the logger holds a reference to it too)."""


def _ddp_modules(module: torch.nn.Module) -> list[DistributedDataParallel]:
    """DDP modules in or around ``module``: itself, ``torch.compile``'s wrapper, submodules."""
    found = [m for m in module.modules() if isinstance(m, DistributedDataParallel)]
    original = _torch.compiled_original(module)
    if isinstance(original, DistributedDataParallel) and original not in found:
        found.append(original)
    return found


def close_ddp(*modules: torch.nn.Module, destroy_process_group: bool = True) -> None:
    """Release the DDP reducers of ``modules``, then destroy the default process group.

    Call it once training is over, with every DDP model (or ``torch.compile``-wrapped DDP
    model, or a module holding DDP submodules) the process created; the modules cannot run
    forward afterwards. See Note [Teardown deadlock].

    Args:
        modules: the DDP-wrapped models.
        destroy_process_group: also destroy the default process group (when initialised).
    """
    for module in modules:
        for ddp in _ddp_modules(module):
            for name in _REDUCER_OWNERS:
                if hasattr(ddp, name):
                    delattr(ddp, name)
    gc.collect()  # reducers caught in reference cycles go now, while the group is alive
    if destroy_process_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
