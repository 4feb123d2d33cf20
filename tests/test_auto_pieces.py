"""min_piece_mb="auto": buckets grouped by predicted step time (issue 26, part 1).

Note [Choosing pieces by cost] in plan.py: a search over even groupings of consecutive
buckets, never cutting inside one, minimising fixed costs + backward + the communication left
after it.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import SplitConfig, SplitConfigError, ddp_split, plan_split
from ddp_split_backend.plan import TOLERANCE, _best_grouping, _even_groupings, _predicted_step

from .models import MLP
from .test_pieces import CAP_MB, _dynamo_graph


@pytest.mark.parametrize("seed", range(40))
def test_the_search_picks_the_fewest_pieces_near_the_best_even_grouping(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    backward = [rng.uniform(0.01, 3.0) for _ in range(n)]
    comm = [rng.choice([0.0, rng.uniform(0.0, 6.0)]) for _ in range(n)]
    fixed = rng.choice([0.0, 0.05, 0.3, 2.0])
    launch = [rng.choice([0.0, rng.uniform(0.0, 1.0)]) for _ in range(n)]
    found = _best_grouping(backward, comm, fixed, launch)
    assert sum(found) == n and all(size >= 1 for size in found)
    step = _predicted_step(backward, comm, fixed, launch, found)
    candidates = _even_groupings(backward, comm) if n > 1 else [[n]]
    best = min(_predicted_step(backward, comm, fixed, launch, sizes) for sizes in candidates)
    assert step <= best * (1 + TOLERANCE) + 1e-12
    near = [sizes for sizes in candidates if _predicted_step(backward, comm, fixed, launch, sizes) <= best * (1 + TOLERANCE)]
    assert len(found) == min(len(sizes) for sizes in near)
    for per_piece in range(1, n + 1):  # never worse than any fixed number of buckets per piece
        uniform = [per_piece] * (n // per_piece) + ([n % per_piece] if n % per_piece else [])
        assert step <= _predicted_step(backward, comm, fixed, launch, uniform) * (1 + TOLERANCE) + 1e-12 or (
            per_piece & (per_piece - 1)  # not a power of two: only the ladder's counts are tried
        )


def test_candidates_are_even_in_backward_time() -> None:
    """No uneven grouping (a small piece first to start the link early) is a candidate: the
    groups balanced by backward time differ by at most two buckets' time (each boundary is
    within one bucket of its ideal place); the others are equal counts of buckets."""
    from ddp_split_backend.plan import _balanced, _prefix

    rng = random.Random(0)
    backward = [rng.uniform(0.5, 1.5) for _ in range(40)]
    for pieces in range(1, 41):
        sizes = _balanced(_prefix(backward), pieces)
        times, i = [], 0
        for size in sizes:
            times.append(sum(backward[i:i + size]))
            i += size
        assert len(sizes) == pieces and max(times) - min(times) <= 2 * max(backward) + 1e-12, sizes


def test_the_search_in_the_limits() -> None:
    backward = [1.0] * 6
    assert _best_grouping(backward, [0.0] * 6, 0.1, [0.0] * 6) == [6]  # nothing to overlap: one piece
    assert _best_grouping(backward, [0.9] * 6, 0.0, [0.0] * 6) == [1] * 6  # free pieces: every cut overlaps more
    assert _best_grouping(backward, [1.0] * 6, 100.0, [0.0] * 6) == [6]  # pieces cost more than any overlap


def test_a_link_that_keeps_up_with_ddps_launches_needs_one_piece() -> None:
    """DDP launches a piece's buckets one by one: where that is slower than the link sends
    them, one piece hides all but the last bucket's communication, and more pieces only add
    their cost (the overhead model of benchmarks/step_overhead.py at comm 0.5 x backward)."""
    backward, comm = [1.0] * 6, [0.5] * 6
    assert len(_best_grouping(backward, comm, 0.1, [0.0] * 6)) > 1  # launches free: overlap pays
    assert _best_grouping(backward, comm, 0.1, [0.6] * 6) == [6]
    assert len(_best_grouping(backward, [0.9] * 6, 0.1, [0.1] * 6)) > 1  # the link slower: overlap pays
    one_piece = _predicted_step(backward, comm, 0.1, [0.6] * 6, [6])
    assert one_piece == pytest.approx(6 * 1.0 + 6 * 0.6 + 0.5 + 0.1)  # only the last bucket's send is exposed


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


def _comm_bound(n: int, seed: int) -> tuple[list[float], list[float], float, list[float]]:
    rng = random.Random(seed)
    backward = [rng.uniform(0.5, 1.5) * 1e-3 for _ in range(n)]
    comm = [rng.uniform(0.2, 3.0) * 1e-3 for _ in range(n)]
    launch = [rng.uniform(0.0, 0.3) * 1e-3 for _ in range(n)]
    return backward, comm, 0.3e-3, launch


@pytest.mark.parametrize("n", [33, 200, 2000])
def test_many_buckets_are_grouped_no_worse_than_the_simple_groupings(n: int) -> None:
    """Never worse than one piece, one piece per bucket, or a power-of-two number of buckets
    per piece (what min_piece_mb gives on equal buckets)."""
    for seed in range(3):
        backward, comm, fixed, launch = _comm_bound(n, seed)
        found = _best_grouping(backward, comm, fixed, launch)
        assert sum(found) == n and all(size >= 1 for size in found)
        step = _predicted_step(backward, comm, fixed, launch, found)
        for per_piece in (1, 2, 4, 8, 16, n):
            sizes = [per_piece] * (n // per_piece) + ([n % per_piece] if n % per_piece else [])
            assert step <= _predicted_step(backward, comm, fixed, launch, sizes) * (1 + TOLERANCE) + 1e-12, per_piece


def test_the_search_stays_near_linear() -> None:
    """Counted, not timed: the candidates grow like log(buckets)."""
    counts = {n: len(_even_groupings([1.0] * n, [1.0] * n)) for n in (100, 1_000, 10_000)}
    assert counts[10_000] < 2 * counts[100] + 20, counts
