"""Models users train (transformers, timm, torchvision; tiny configs) in 2-rank gloo DDP
through the default path, against eager DDP.

Tolerances, per inner backend:

* ``aot_eager`` runs the same ATen kernels as eager, only cut into pieces: in float32 it must
  match eager DDP within ``torch.testing``'s float32 defaults (rtol 1.3e-6, atol 1e-5). Under
  bf16 autocast it is judged like inductor (below, tol 1e-2): measured bit-identical on every
  case on torch 2.13, but on 2.11 plain ``torch.compile(backend="aot_eager")`` of Llama under
  bf16 autocast, no DDP and no split, already ends 2.4e-5 from eager after 3 steps, and the
  CI matrix of 2026-12-05 saw ddp_split's Llama bf16 gradients 2.6e-4 from eager there.
* ``inductor`` fuses and reorders floating-point work, so it is judged the way torch judges
  inductor's accuracy (``torch._dynamo.utils.same``, the check of torch's dynamo/inductor
  benchmark suites): each loss, gradient and parameter must be within ``tol`` of eager, or
  no further from a float64 eager run than 3x eager's own float32 error (+ tol/10). ``tol``
  is 1e-4 in float32 and 1e-2 under bf16 autocast. A plain ``allclose`` fails here for reasons
  that are inductor's, not the split's: ResNet-18's first conv gradient sums 8x64x64
  products, and plain ``torch.compile(backend="inductor")`` without any split differs from
  eager there by the same 0.025 as ddp_split does (checked).
"""

from __future__ import annotations

import pytest
import torch

from ddp_split_backend import Outcome

from .multiproc import run_ranks

transformers = pytest.importorskip("transformers", reason="install the 'models' extra (make test does)")

from .real_models import CASES, RUN, RealCase, run_real_cases, why_not_run  # noqa: E402

pytestmark = pytest.mark.multiprocess


AOT_EAGER_TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}


def _check_inductor(name: str, actual: list, expected: list, reference64: list, amp: bool) -> None:
    from torch._dynamo.utils import same

    tol = 1e-2 if amp else 1e-4
    for i, (a, e, r) in enumerate(zip(actual, expected, reference64, strict=True)):
        errors: list[str] = []
        ok = same(e, a, fp64_ref=r, tol=tol, exact_dtype=False, log_error=lambda *m: errors.append(str(m)))
        assert ok, f"{name}[{i}] beyond inductor's accuracy check (tol {tol}): {errors}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Every case in one 2-rank run (one process start-up for all of them)."""
    return run_ranks(run_real_cases, tmp_path_factory.mktemp("real_models"), world=2, timeout=1200, cases=RUN)


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.skip(reason=why_not_run(c.model))) if why_not_run(c.model) else c
    for c in CASES
], ids=[c.id for c in CASES])
def test_real_model_trains_like_eager_ddp(results, case: RealCase) -> None:
    for rank, per_rank in enumerate(results):
        result = per_rank[case.id]
        expected, actual = result["expected"], result["actual"]
        assert min(result["pieces"]) >= 1 and max(result["pieces"]) >= 3, (rank, result["pieces"])
        assert Outcome.EAGER_FALLBACK not in result["outcomes"], result["compiled_by"]
        assert set(result["sources"]) == {"ddp_split"}, "ddp_split, not DDPOptimizer, planned every graph"
        for what in ("losses", "grads", "params"):
            if case.inner == "aot_eager" and not case.amp:
                for i, (a, e) in enumerate(zip(actual[what], expected[what], strict=True)):
                    torch.testing.assert_close(a, e, **AOT_EAGER_TOLERANCE, msg=lambda m, w=what, i=i: f"{w}[{i}]: {m}")
            else:
                _check_inductor(what, actual[what], expected[what], result["reference64"][what], case.amp)
    for a, b in zip(results[0][case.id]["actual"]["params"], results[1][case.id]["actual"]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the allreduce kept the ranks identical


def test_cap_below_one_mib_cuts_every_model(results) -> None:
    """DDPOptimizer asserts on caps below its 1 MiB first bucket; ddp_split cuts at them."""
    for case in RUN:
        result = results[0][case.id]
        if case.cap == "small":
            assert result["cap_mb"] < 1.0
            assert max(result["pieces"]) >= 4, (case.id, result["pieces"])


def test_identical_blocks_share_a_compile_on_the_default_path(results) -> None:
    """Reuse is on for inner backends given by name: repeated transformer blocks compile once."""
    shared = {c.model for c in RUN if Outcome.SHARED in results[0][c.id]["outcomes"]}
    assert {c.model for c in RUN if c.model in ("gpt2", "llama", "bert")} <= shared, shared


def test_pieces_against_reducer_buckets(results) -> None:
    """DDP rebuilds its buckets in the order gradients become ready, and ddp_split makes that
    order the plan's (Note [Pieces are DDP's buckets]): every piece holding parameters is
    exactly one of the buckets DDP's reducer holds, in every case (both inner backends, both
    wrapping orders, bf16 autocast, caps below 1 MiB). Prints the figures."""
    print("\ncase: pieces equal to a reducer bucket / pieces with parameters; pieces per bucket; s")
    for case in RUN:
        r = results[0][case.id]
        print(f"  {case.id:42s} {r['matched']}/{r['param_pieces']} (buckets {r['buckets']}); "
              f"spans {r['spans']}; {r['seconds']:.1f} s")
        assert r["matched"] == r["param_pieces"] and max(r["spans"]) == 1, (case.id, r["spans"])
