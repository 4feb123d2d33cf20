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
        assert not any(r["partial"]), (case, "a graph holds part of the model", r["partial"])
        assert r["param_pieces"] > 1, (case, r)
        assert r["matched"] == r["param_pieces"] and max(r["spans"]) == 1, (rank, case, r["spans"], r["reducer"])
        assert all(done and matched == pieces for done, matched, pieces in r["checks"][:1]), r["checks"]
        for actual, expected in zip(r["params"], r["expected"], strict=True):
            torch.testing.assert_close(actual, expected)


def test_every_library_is_covered() -> None:
    assert {LIBRARY[_MODEL.get(c, c)] for c in BUCKET_CASES} == {"transformers", "timm", "torchvision"}
