"""min_piece_mb="auto": buckets grouped by predicted step time (issue 26, part 1).

Note [Choosing pieces by cost] in plan.py: a search over groupings of consecutive buckets,
never cutting inside one, minimising fixed costs + backward + the communication left after
it (exact up to EXACT_BUCKETS buckets, among balanced groupings above).
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import SplitConfig, SplitConfigError, ddp_split, plan_split
from ddp_split_backend.plan import EXACT_BUCKETS, TOLERANCE, _best_grouping, _predicted_step

from .models import MLP
from .test_pieces import CAP_MB, _dynamo_graph


def _compositions(n: int):
    """Every way to cut n buckets into consecutive groups."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        yield [*sizes, size]


@pytest.mark.parametrize("seed", range(40))
def test_the_search_finds_the_best_grouping(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    backward = [rng.uniform(0.01, 3.0) for _ in range(n)]
    comm = [rng.choice([0.0, rng.uniform(0.0, 6.0)]) for _ in range(n)]
    fixed = rng.choice([0.0, 0.05, 0.3, 2.0])
    by_pieces: dict[int, float] = {}  # the best predicted step for each number of pieces
    for sizes in _compositions(n):
        step = _predicted_step(backward, comm, fixed, sizes)
        by_pieces[len(sizes)] = min(step, by_pieces.get(len(sizes), step))
    best = min(by_pieces.values())
    fewest = min(m for m, step in by_pieces.items() if step <= best * (1 + TOLERANCE))
    found = _best_grouping(backward, comm, fixed)
    assert sum(found) == n and all(size >= 1 for size in found)
    assert len(found) == fewest  # the fewest pieces predicted within TOLERANCE of the best
    assert _predicted_step(backward, comm, fixed, found) == pytest.approx(by_pieces[fewest], rel=1e-12, abs=1e-12)


def test_the_search_in_the_limits() -> None:
    backward = [1.0] * 6
    assert _best_grouping(backward, [0.0] * 6, fixed=0.1) == [6]  # nothing to overlap: one piece
    assert _best_grouping(backward, [0.9] * 6, fixed=0.0) == [1] * 6  # free pieces: every cut overlaps more
    assert _best_grouping(backward, [1.0] * 6, fixed=100.0) == [6]  # pieces cost more than any overlap


def _auto_plan(**options):
    gm, inputs = _dynamo_graph()
    config = SplitConfig(bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB, min_piece_mb="auto", **options)
    return plan_split(gm, inputs, config=config)


@pytest.mark.parametrize("link_gbps", [1e-4, 1.0, math.inf])
def test_auto_only_chooses_which_bucket_boundaries_to_keep(link_gbps) -> None:
    gm, inputs = _dynamo_graph()
    default = plan_split(gm, inputs, config=SplitConfig(bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB))
    plan = _auto_plan(link_gbps=link_gbps)
    assert [(b.start, b.stop, b.nbytes, b.params) for b in plan.buckets] == [
        (b.start, b.stop, b.nbytes, b.params) for b in default.buckets
    ]  # DDP's buckets, unchanged
    assert set(plan.cuts) <= {b.start for b in plan.buckets}  # never inside a bucket
    assert [b.piece for b in plan.buckets] == sorted(b.piece for b in plan.buckets)  # consecutive
    sizing = plan.sizing
    assert sizing is not None and len(sizing.bucket_backward_s) == len(plan.buckets)
    assert sizing.predicted_s <= min(sizing.one_per_bucket_s, sizing.one_piece_s) * (1 + TOLERANCE) + 1e-12
    if link_gbps == math.inf:
        assert len(plan.pieces) == 1  # an instant link: nothing to overlap, one piece
    # A slow link splits models with milliseconds of backward per bucket
    # (test_auto_by_name_matches_eager_ddp); here what a cut could hide is below TOLERANCE.


def test_the_table_says_why() -> None:
    table = _auto_plan(link_gbps=1.0).table()
    assert "grouped by predicted cost (min_piece_mb='auto')" in table
    assert "bwd ms" in table.splitlines()[1]
    assert "auto: predicted step" in table and "link_gbps=1" in table and "fixed cost" in table


@pytest.mark.parametrize(
    "options,words",
    [
        ({"min_piece_mb": "automatic"}, ["'min_piece_mb'", "'automatic'", "'auto'"]),
        ({"min_piece_mb": None, "link_gbps": 10}, ["'link_gbps'=10", "min_piece_mb='auto'"]),
        ({"min_piece_mb": "auto", "link_gbps": 0}, ["'link_gbps'", "got 0", "float('inf')"]),
        ({"min_piece_mb": "auto", "link_gbps": -1.0}, ["'link_gbps'", "got -1.0"]),
        ({"min_piece_mb": "auto", "link_gbps": float("nan")}, ["'link_gbps'", "got nan"]),
        ({"min_piece_mb": "auto", "link_gbps": "fast"}, ["'link_gbps'", "got 'fast'"]),
        ({"min_piece_mb": "auto"}, ["'link_gbps'", "link_gbps=10", "watch_overlap", "min_piece_mb"]),
    ],
)
def test_bad_auto_options_name_the_option_and_the_fix(options, words) -> None:
    with pytest.raises(SplitConfigError) as info:
        SplitConfig.from_options(options)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_auto_by_name_matches_eager_ddp(world1) -> None:
    """Layers with milliseconds of backward each (1024 x 1024 at batch 64, a bucket per
    layer) over a link that sends at 1 GB/s, four times as long as the backward: the first
    bucket to be ready gets a piece of its own."""
    torch.manual_seed(0)
    base = MLP(width=1024, depth=4)
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=4)
    split_ddp = DDP(copy.deepcopy(base), bucket_cap_mb=4)
    compiled = torch.compile(
        split_ddp, backend="ddp_split", options={"inner": "aot_eager", "min_piece_mb": "auto", "link_gbps": 1.0}
    )
    x = torch.randn(64, 1024)
    with ddp_split_backend.own_split():
        for _ in range(2):
            for model in (eager, compiled):
                model.zero_grad()
                model(x).pow(2).mean().backward()
            for a, e in zip(split_ddp.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(a.grad, e.grad)
    plan = ddp_split.records[-1].plan
    assert plan.sizing is not None and len(plan.buckets) == 4
    assert len(plan.pieces) > 1 and len(plan.pieces[-1].buckets) == 1, plan.table()


def _comm_bound(n: int, seed: int) -> tuple[list[float], list[float], float]:
    rng = random.Random(seed)
    backward = [rng.uniform(0.5, 1.5) * 1e-3 for _ in range(n)]
    comm = [rng.uniform(0.2, 3.0) * 1e-3 for _ in range(n)]
    return backward, comm, 0.3e-3


@pytest.mark.parametrize("n", [EXACT_BUCKETS + 1, 200, 2000])
def test_many_buckets_are_grouped_no_worse_than_the_simple_groupings(n: int) -> None:
    """Above EXACT_BUCKETS the search is among balanced groupings: never worse than one piece,
    one piece per bucket, or any fixed number of buckets per piece (what min_piece_mb gives)."""
    for seed in range(3):
        backward, comm, fixed = _comm_bound(n, seed)
        found = _best_grouping(backward, comm, fixed)
        assert sum(found) == n and all(size >= 1 for size in found)
        step = _predicted_step(backward, comm, fixed, found)
        for per_piece in (1, 2, 4, 8, 16, n):
            sizes = [per_piece] * (n // per_piece) + ([n % per_piece] if n % per_piece else [])
            assert step <= _predicted_step(backward, comm, fixed, sizes) * (1 + TOLERANCE) + 1e-12, per_piece


def test_the_search_stays_near_linear() -> None:
    """Counted, not timed: the candidates above EXACT_BUCKETS grow like log(buckets)."""
    from ddp_split_backend.plan import _balanced_groupings

    counts = {n: len(_balanced_groupings([1.0] * n, [1.0] * n)) for n in (100, 1_000, 10_000)}
    assert counts[10_000] < 2 * counts[100] + 20, counts
