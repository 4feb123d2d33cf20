"""The compile stage: outcomes as data, ``on_inner_failure``, AOT backward metadata, and the
private torch names behind one door."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

import ddp_split_backend
from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig, _torch
from ddp_split_backend.guards import GlobalState

from .helpers import CountingCompiler
from .models import MLP


def test_every_private_torch_name_resolves_and_says_what_it_is_for() -> None:
    assert len(_torch.PRIVATE_NAMES) >= 40
    for name in _torch.PRIVATE_NAMES:
        assert name.purpose, name.path
        parts = name.path.split(".")
        assert "._" in name.path or any(p.startswith("_") for p in parts) or name.path.startswith(
            "torch.ops.profiler"
        ) or "fx.experimental" in name.path, f"{name.path} is public: use it directly"
        module, attrs = parts[0], parts[1:]
        value = importlib.import_module(module)
        for attr in attrs:
            value = getattr(value, attr)
        assert value is not None, name.path
    context = _torch.TracingContext(None)  # fields read and written through _torch helpers
    assert hasattr(context, "fw_metadata") and hasattr(context, "fakify_first_call")


def test_a_missing_private_name_fails_with_the_symbol_and_torch_version() -> None:
    with pytest.raises(_torch.TorchInternalsError, match=r"torch\._C\._no_such_symbol.*" + torch.__version__.replace("+", r"\+")):
        _torch._resolve("torch._C._no_such_symbol", "a test")
    _torch.PRIVATE_NAMES.pop()


def test_no_module_but_the_door_names_private_torch_modules() -> None:
    """Code (not docstrings or comments) names ``torch._*`` only in ``_torch.py``."""
    import io
    import pathlib
    import tokenize

    package = pathlib.Path(ddp_split_backend.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        if path.name == "_torch.py":
            continue
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                  if t.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
        for first, dot, attr in zip(tokens, tokens[1:], tokens[2:]):
            if first.string == "torch" and dot.string == "." and attr.string.startswith("_") and not attr.string.startswith("__"):
                offenders.append(f"{path.name}:{first.start[0]}: torch.{attr.string}")
    assert not offenders, "\n".join(offenders)


def test_on_inner_failure_raise_propagates_with_the_piece_named_and_state_restored() -> None:
    counting = CountingCompiler(fail_on={1})
    backend = DDPSplitBackend(SplitConfig(inner=counting, bucket_cap_mb=0.015, on_inner_failure="raise"))
    model = MLP(width=64, depth=3)
    before = GlobalState.capture()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(Exception) as failure:
        torch.compile(model, backend=backend)(torch.randn(2, 64))
    error = failure.value
    chain = [error, error.__cause__, getattr(error, "inner_exception", None)]
    planned = next(e for e in chain if type(e) is RuntimeError and "planned failure" in str(e))
    notes = getattr(planned, "__notes__", [])
    assert any("failed on piece 1 of 3" in note for note in notes), notes
    assert GlobalState.capture() == before
    assert counting.count == 2  # nothing after the failing piece was compiled


def test_on_inner_failure_eager_records_the_exception_with_its_traceback() -> None:
    counting = CountingCompiler(fail_on={0})
    backend = DDPSplitBackend(SplitConfig(inner=counting, bucket_cap_mb=0.015))
    model = MLP(width=64, depth=3)
    x = torch.randn(2, 64)
    with pytest.warns(UserWarning, match="failed on piece 0 of 3"):
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    (record,) = backend.records
    assert [r.outcome for r in record.pieces] == [Outcome.EAGER_FALLBACK, Outcome.COMPILED, Outcome.COMPILED]
    failed = record.pieces[0]
    assert isinstance(failed.error, RuntimeError) and failed.error.__traceback__ is not None
    assert record.failures == (failed,)


def test_one_bucket_graph_gets_a_record_too() -> None:
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager"))
    model = MLP(width=8, depth=2)
    x = torch.randn(2, 8)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    (record,) = backend.records
    assert [(r.piece, r.outcome, r.backend) for r in record.pieces] == [(0, Outcome.COMPILED, "aot_eager")]


def test_graph_names_count_past_the_records_kept() -> None:
    backend = DDPSplitBackend(SplitConfig(inner="eager"), keep_records=2)
    for width in (3, 4, 5):
        torch._dynamo.reset()
        torch.compile(nn.Linear(width, width), backend=backend)(torch.randn(1, width))
    assert [r.plan.graph_name.split(" [")[0] for r in backend.records] == ["graph 1", "graph 2"]


class GradModes(nn.Module):
    """Pieces run grad, no_grad, inference (ending with ``clone() + h`` outside the region),
    grad, grad. The first piece's output also feeds the third's add, so backward reaches
    pieces 4, 3, 2 and 0, and never the no_grad piece."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = h = torch.relu(self.layers[0](x))
        with torch.no_grad():
            x = torch.relu(self.layers[1](x))
        with torch.inference_mode():
            x = torch.relu(self.layers[2](x))
        x = x.clone() + h
        x = torch.relu(self.layers[3](x))
        return torch.relu(self.layers[4](x))


@pytest.mark.parametrize("reuse", [False, True], ids=["no-reuse", "reuse"])
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_backward_metadata_only_for_pieces_with_a_backward(inner: str, reuse: bool) -> None:
    torch.manual_seed(0)
    model = GradModes()
    x = torch.randn(4, 64)
    expected = model(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    backend = DDPSplitBackend(SplitConfig(inner=inner, bucket_cap_mb=0.015, reuse_identical_pieces=reuse))
    actual = torch.compile(model, backend=backend)(x)
    actual.sum().backward()
    (record,) = backend.records
    assert len(record.plan.buckets) == 5, record.plan.table()
    grad_pieces = (0, 2, 3, 4)
    if reuse and any(r.outcome is Outcome.SHARED for r in record.pieces):
        shared = {r.piece: r.shared_with for r in record.pieces if r.outcome is Outcome.SHARED}
        assert shared == {4: 3}, shared  # the last two blocks are alike; pushed once, at the last use
        grad_pieces = (0, 2, 4)
    assert record.backward_order == grad_pieces
    tol = {} if inner == "aot_eager" else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(actual, expected, **tol)
    for p, e in zip(model.parameters(), expected_grads, strict=True):
        if e is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, e, **tol)


class MetadataWitness:
    """An AOTAutograd inner backend whose forward compiler notes each piece's forward
    metadata and whose (lazy) backward compiler notes the metadata it is handed."""

    def __init__(self) -> None:
        self.forward: list[object] = []
        self.backward: list[object] = []
        self.__name__ = "metadata_witness"

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def fw_compiler(graph, inputs):
            self.forward.append(_torch.aot_fw_metadata(_torch.TracingContext.try_get()))
            return graph.forward

        def bw_compiler(graph, inputs):
            self.backward.append(_torch.aot_fw_metadata(_torch.TracingContext.try_get()))
            return graph.forward

        return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)(gm, example_inputs)


def test_each_backward_compile_sees_its_own_pieces_metadata() -> None:
    """Backward reaches pieces 4, 3, 2 and 0 (not the no_grad piece 1), and each backward
    compile must be handed the forward metadata of that very piece."""
    witness = MetadataWitness()
    backend = DDPSplitBackend(SplitConfig(inner=witness, bucket_cap_mb=0.015))
    model = GradModes()
    torch.compile(model, backend=backend)(torch.randn(4, 64)).sum().backward()
    assert len(witness.forward) == 5
    by_piece = dict(enumerate(witness.forward))
    names = {id(m): i for i, m in by_piece.items()}
    assert [names.get(id(m), "other") for m in witness.backward] == [4, 3, 2, 0]
    assert backend.records[-1].backward_order == (0, 2, 3, 4)
