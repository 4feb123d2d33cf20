"""One grouping for every rank: ``min_piece_mb="auto"`` re-plans with the first rank's choice.

Note [One plan for every rank]
------------------------------
Each rank measures its own first steps (Note [Measuring the link] in ``regroup.py``), and
measurements differ a little between ranks, so two ranks could group the same graph
differently: runs that are not reproducible, and ranks that compile different pieces for
different times while the others wait in an allreduce. So at the re-plan every rank uses the
grouping of its DDP process group's first rank:

* the first rank writes its grouping into the process group's store (the key/value store
  every process of the job already shares) and goes on at once;
* every other rank waits for that key, at most :data:`WAIT_S` seconds, and uses what it
  finds. If nothing came (that rank never re-planned this graph: different graphs per rank)
  or it does not fit (another number of buckets), it keeps its own grouping and warns.

This cannot deadlock: it is not a collective. Nobody waits on the first rank longer than
:data:`WAIT_S`, and the first rank waits on nobody. All ranks re-plan in the same training
step (each counts the same synchronised steps, and DDP's allreduce keeps them in step), so
the wait is normally one step's skew. Keys name the process group's ranks, the graph's code
and how many times this process re-planned that code, so a sweep's next trial or a second
model of the class never reads an earlier decision.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import _torch

__all__ = ["WAIT_S", "agreed_grouping"]

WAIT_S = 120.0
"""How long a rank waits for the first rank's grouping before it keeps its own."""

_replans: collections.Counter[str] = collections.Counter()
"""Re-plans per graph key in this process (the same count on every rank)."""


def agreed_grouping(ddp: torch.nn.Module | None, graph_code: str, mine: Sequence[int]) -> tuple[tuple[int, ...], int | None]:
    """The piece of each bucket this rank should use, and the global rank it came from
    (``None``: this rank's own, alone in its group or nothing usable arrived)."""
    mine = tuple(mine)
    group = getattr(ddp, "process_group", None)
    if ddp is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return mine, None
    ranks = dist.get_process_group_ranks(group)
    graph = hashlib.sha1(graph_code.encode()).hexdigest()[:16]
    base = f"ddp_split/grouping/{'-'.join(map(str, ranks))}/{graph}"
    _replans[base] += 1
    key = f"{base}/{_replans[base]}"
    store = _torch.default_store()
    if dist.get_rank() == ranks[0]:
        store.set(key, json.dumps(mine))
        return mine, None
    try:
        store.wait([key], datetime.timedelta(seconds=WAIT_S))
        theirs = tuple(json.loads(store.get(key)))
    except Exception as error:  # the first rank never got here: different graphs per rank
        warnings.warn(
            f"ddp_split: rank {ranks[0]}'s grouping of this graph did not arrive within {WAIT_S:g} s "
            f"({type(error).__name__}); this rank keeps its own, which may differ",
            stacklevel=2,
        )
        return mine, None
    if len(theirs) != len(mine):
        warnings.warn(
            f"ddp_split: rank {ranks[0]} grouped {len(theirs)} buckets where this rank has {len(mine)}; "
            "this rank keeps its own grouping",
            stacklevel=2,
        )
        return mine, None
    return theirs, ranks[0]
