"""How ddp_split meets torch's DDPOptimizer (see the README's Troubleshooting, "DDPOptimizer takeover").

With ``torch._dynamo.config.optimize_ddp`` at its default (True), Dynamo wraps *any* backend
in DDPOptimizer whenever a DDP module is active, before the backend sees the graph: the
backend is then called once per DDPOptimizer piece. torch gives a backend passed by name no
hook that runs before that decision (``torch.compile`` wraps named backends in an object
that drops ``backend_ctx_ctor``), so ddp_split cannot switch it off by itself without
changing global config behind the user's back. It therefore

* never splits a piece DDPOptimizer already cut (it compiles it whole and warns once), and
* offers :func:`own_split`, a context manager that turns DDPOptimizer off only while it is
  active and restores the setting afterwards, also on error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


from . import _torch

__all__ = ["own_split"]


@contextlib.contextmanager
def own_split() -> Iterator[None]:
    """Let ``ddp_split`` plan DDP graphs itself while the body runs.

    Example::

        model = torch.compile(DDP(net), backend="ddp_split")
        with ddp_split_backend.own_split():
            for batch in loader:
                model(batch).sum().backward()
    """
    with _torch.dynamo_config.patch(optimize_ddp=False):
        yield
