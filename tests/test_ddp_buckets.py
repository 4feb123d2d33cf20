"""The buckets DDP rebuilds are ddp_split's pieces (Note [Pieces are DDP's buckets]).

Real models (transformers, timm, torchvision; tiny configs), 2 gloo ranks, default options,
``backend="ddp_split"`` by name with aot_eager, 10 SGD steps: after DDP's rebuild every piece
holding parameters is exactly one of the buckets DDP's reducer holds, no bucket spans two
pieces, ddp_split's own check (``CompileRecord.buckets``) says the same, and the parameters
match eager DDP's.
"""

from __future__ import annotations

import pytest
import torch

from .multiproc import run_ranks

pytest.importorskip("transformers", reason="install the 'models' extra (make test does)")

from .bucket_cases import BUCKET_CASES, run_bucket_cases  # noqa: E402
from .real_models import LIBRARY, why_not_run  # noqa: E402

pytestmark = pytest.mark.multiprocess

_MODEL = {"gpt2_varying": "gpt2"}
RUN = tuple(c for c in BUCKET_CASES if why_not_run(_MODEL.get(c, c)) is None)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(run_bucket_cases, tmp_path_factory.mktemp("ddp_buckets"), world=2, timeout=900, cases=RUN)


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.skip(reason=why_not_run(_MODEL.get(c, c)) or "")) if c not in RUN else c
    for c in BUCKET_CASES
], ids=list(BUCKET_CASES))
def test_pieces_are_the_buckets_ddp_rebuilt(results, case: str) -> None:
    for rank, result in enumerate(results):
        r = result[case]
        # Graphs holding parameters hold all of them (a loss-only graph after a graph break holds none).
        assert not any(r["partial"]), (case, "a graph holds part of the model's parameters", r["partial"])
        assert r["param_pieces"] > 1, (case, r)
        assert r["matched"] == r["param_pieces"] and max(r["spans"]) == 1, (rank, case, r["spans"], r["reducer"])
        checked = [(matched, pieces) for done, matched, pieces in r["checks"] if done]
        assert checked and all(matched == pieces for matched, pieces in checked), r["checks"]
        for actual, expected in zip(r["params"], r["expected"], strict=True):
            torch.testing.assert_close(actual, expected)


def test_every_library_is_covered() -> None:
    assert {LIBRARY[_MODEL.get(c, c)] for c in BUCKET_CASES} == {"transformers", "timm", "torchvision"}


class _TiedStack(torch.nn.Module):
    """Tied input/output embeddings (one parameter used first and last), small LayerNorm
    parameters between large weights, a weight used twice: at DDP's default caps (the first
    bucket 1 MiB, then 25 MiB) its 34 MiB of gradients make three buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(512, 1024)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(1024) for _ in range(8))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for norm, layer in zip(self.norms, self.layers):
            h = h + torch.tanh(layer(norm(h)))
        h = self.layers[0](h)  # the first layer's weight again: complete at its first use
        return (h @ self.emb.weight.t()).logsumexp(-1).mean()


@pytest.mark.parametrize("ddp_kwargs", [{}, {"static_graph": True}, {"gradient_as_bucket_view": True}],
                         ids=["default", "static_graph", "bucket_view"])
def test_default_caps_tied_and_shared_parameters_make_the_pieces_the_buckets(world1, ddp_kwargs, recwarn) -> None:
    import copy

    import ddp_split_backend
    from ddp_split_backend import ddp_split
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .helpers import piece_bucket_agreement

    torch.manual_seed(0)
    base = _TiedStack()
    eager, ddp = DDP(copy.deepcopy(base), **ddp_kwargs), DDP(copy.deepcopy(base), **ddp_kwargs)
    model = torch.compile(ddp, backend="ddp_split", options={"inner": "aot_eager"})
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    with ddp_split_backend.own_split():
        for _ in range(3):
            for m in (eager, model):
                m(ids).backward()
    (record,) = ddp_split.records
    matched, pieces, spans = piece_bucket_agreement(ddp, [record.plan])
    assert pieces == 3 and matched == pieces and set(spans) == {1}, (matched, pieces, spans, record.plan.table())
    assert record.buckets.done and record.buckets.pieces_matched == record.buckets.pieces == 3
    assert record.buckets.as_planned and not [w for w in recwarn if "DDP rebuilt" in str(w.message)]
    for actual, expected in zip(ddp.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad)


def test_grouped_pieces_hold_whole_buckets_and_the_check_says_so(world1, recwarn) -> None:
    """With ``min_piece_mb`` a piece holds several of DDP's buckets: no bucket straddles two
    pieces, the check finds DDP's buckets as planned, and nothing warns."""
    import ddp_split_backend
    from ddp_split_backend import ddp_split
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(_TiedStack(), bucket_cap_mb=2)
    model = torch.compile(ddp, backend="ddp_split", options={"inner": "aot_eager", "min_piece_mb": 8})
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    with ddp_split_backend.own_split():
        for _ in range(3):
            model(ids).backward()
    (record,) = ddp_split.records
    check = record.buckets
    assert len(record.plan.pieces) < len(record.plan.buckets) and check.done, record.plan.table()
    assert check.as_planned and not check.straddling, check
    assert not [w for w in recwarn if "DDP rebuilt" in str(w.message)]


def test_watch_overlap_names_the_piece_each_bucket_became(world1) -> None:
    import ddp_split_backend
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(_TiedStack())
    watch = ddp_split_backend.watch_overlap(ddp, warmup=2, steps=2)
    model = torch.compile(ddp, backend="ddp_split", options={"inner": "aot_eager"})
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    with ddp_split_backend.own_split():
        for _ in range(5):
            model(ids).backward()
    report = watch.report()
    watch.remove()
    # DDP's bucket 0 (ready first) is the last piece; three buckets, three pieces.
    assert report.pieces == {0: "graph 0 piece 2", 1: "graph 0 piece 1", 2: "graph 0 piece 0"}, report.pieces
    assert "graph 0 piece 2" in report.table()
