"""``min_piece_mb``: consecutive DDP buckets grouped into one piece, never a cut inside one.

MLP(width=64, depth=8): every Linear holds 16,640 B (0.0159 MiB), so with a cap of 0.015
MiB each layer is its own DDP bucket (8 buckets) and ``min_piece_mb`` picks the grouping.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_split_backend import SplitConfig, SplitConfigError, ddp_split, own_split, plan_split

from .helpers import reducer_bucket_names
from .models import MLP
from .multiproc import run_ranks

LAYER_BYTES = 64 * 64 * 4 + 64 * 4
CAP_MB = 0.015


def _dynamo_graph() -> tuple[torch.fx.GraphModule, list]:
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(MLP(width=64, depth=8), backend=grab)(torch.randn(2, 64))
    return graphs[0]


def _plan(min_piece_mb: float | None):
    gm, inputs = _dynamo_graph()
    config = SplitConfig(bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB, min_piece_mb=min_piece_mb)
    return plan_split(gm, inputs, config=config)


@pytest.mark.parametrize(
    "min_piece_mb,groups",
    [
        (None, [[7], [6], [5], [4], [3], [2], [1], [0]]),
        (0.01, [[7], [6], [5], [4], [3], [2], [1], [0]]),  # smaller than a bucket: no change
        (0.03, [[7, 6], [5, 4], [3, 2], [1, 0]]),  # two buckets reach 0.0317 MiB
        (0.04, [[7, 6], [5, 4, 3], [2, 1, 0]]),  # grouped from bucket 0; the front keeps the rest
        (1.0, [[7, 6, 5, 4, 3, 2, 1, 0]]),  # one piece
    ],
)
def test_buckets_are_grouped_from_the_back_and_never_cut(min_piece_mb, groups) -> None:
    plan = _plan(min_piece_mb)
    default = _plan(None)
    assert [b.params for b in plan.buckets] == [b.params for b in default.buckets]  # DDP's buckets kept
    assert len(plan.buckets) == 8 and all(b.nbytes == LAYER_BYTES for b in plan.buckets)
    assert [[b.bucket for b in p.buckets] for p in plan.pieces] == groups
    assert set(plan.cuts) <= {b.start for b in plan.buckets}  # every cut is a bucket boundary
    for piece in plan.pieces:
        assert [b.piece for b in piece.buckets] == [piece.piece] * len(piece.buckets)
        assert piece.start < piece.stop
    for earlier, later in zip(plan.pieces, plan.pieces[1:]):
        assert earlier.stop == later.start
    if min_piece_mb is not None:
        for piece in plan.pieces[1:]:  # all but the front piece reach the minimum
            assert piece.nbytes >= min_piece_mb * 2**20


def test_plan_table_shows_the_buckets_of_each_piece() -> None:
    table = _plan(0.04).table()
    assert "3 pieces" in table and "8 buckets, min piece 41,943 B" in table
    rows = [line.split() for line in table.splitlines()[2:5]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "7-6", "33,280"), ("1", "5-3", "49,920"), ("2", "2-0", "49,920")]
    assert "bucket " in _plan(None).table().splitlines()[1]  # the default table is unchanged


@pytest.mark.parametrize("value", [0, -1.5, float("inf"), "4", True])
def test_bad_min_piece_mb_names_the_option_and_the_fix(value) -> None:
    with pytest.raises(SplitConfigError) as info:
        SplitConfig.from_options({"min_piece_mb": value})
    message = str(info.value)
    assert "'min_piece_mb'" in message and repr(value) in message and "one piece per bucket" in message


def test_grouped_pieces_by_name_match_eager_ddp_and_keep_ddp_buckets(world1) -> None:
    torch.manual_seed(0)
    base = MLP(width=64, depth=8)
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    split_ddp = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    compiled = torch.compile(split_ddp, backend="ddp_split", options={"inner": "aot_eager", "min_piece_mb": 0.04})
    x = torch.randn(4, 64)
    with own_split():
        for _ in range(2):  # the second step runs after DDP rebuilt its buckets
            for model in (eager, compiled):
                model.zero_grad()
                model(x).pow(2).mean().backward()
            for a, e in zip(split_ddp.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(a.grad, e.grad)
    plan = ddp_split.records[-1].plan
    assert [[b.bucket for b in p.buckets] for p in plan.pieces] == [[7, 6], [5, 4, 3], [2, 1, 0]]
    # the two three-layer pieces are identical: one compile serves both
    assert ddp_split.records[-1].compiled_by == ("aot_eager", "aot_eager", "aot_eager (same as piece 1)")
    assert len(reducer_bucket_names(split_ddp)) == len(plan.buckets) == 8


def slow_allreduce(delay_s, bucket):  # no annotations: DDP checks them
    """The mean over ranks, completed ``delay_s`` after the allreduce: a slow link."""
    buffer = bucket.buffer().div_(dist.get_world_size())

    def late(fut):
        time.sleep(delay_s)
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(late)


def _grouped_sgd_worker(
    rank: int,
    world: int,
    steps: int = 3,
    min_piece_mb: float | str = 0.04,
    ddp_kwargs: dict | None = None,
    delay_s: float = 0.0,
    width: int = 64,
    batch: int = 8,
) -> dict:
    """SGD steps of eager DDP and ddp_split side by side; ``delay_s``: both send through
    :func:`slow_allreduce`, each bucket that much late."""
    import ddp_split_backend
    from ddp_split_backend import ddp_split
    from tests.models import MLP

    torch.manual_seed(0)
    base = MLP(width=width, depth=8)
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB, **(ddp_kwargs or {}))
    split_ddp = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB, **(ddp_kwargs or {}))
    if delay_s:
        for ddp in (eager, split_ddp):
            ddp.register_comm_hook(delay_s, slow_allreduce)
    split = torch.compile(split_ddp, backend="ddp_split", options={"inner": "aot_eager", "min_piece_mb": min_piece_mb})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, split)]
    torch.manual_seed(100 + rank)  # each rank sees different data
    batches = [torch.randn(batch, width) for _ in range(steps)]
    with ddp_split_backend.own_split():
        for x in batches:
            for model, opt in zip((eager, split), optimizers):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
    plan = ddp_split.records[-1].plan
    return {
        "eager": [p.detach().clone() for p in eager.parameters()],
        "split": [p.detach().clone() for p in split.parameters()],
        "pieces": [[b.bucket for b in p.buckets] for p in plan.pieces],
        "sized_by_cost": plan.sizing is not None,
        "graph_name": plan.graph_name,
        "sizing": plan.sizing.describe() if plan.sizing else None,
    }


@pytest.mark.multiprocess
def test_two_ranks_grouped_pieces_match_eager_ddp(tmp_path) -> None:
    results = run_ranks(_grouped_sgd_worker, tmp_path, world=2)
    for result in results:
        assert result["pieces"] == [[7, 6], [5, 4, 3], [2, 1, 0]]
        for a, e in zip(result["split"], result["eager"], strict=True):
            torch.testing.assert_close(a, e)
    for a, b in zip(results[0]["split"], results[1]["split"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
