"""The compile stage: outcomes as data, ``on_inner_failure``, AOT backward metadata, and the
private torch names behind one door."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest
import torch
import torch.nn as nn

import ddp_split_backend
from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig, _torch
from ddp_split_backend.guards import GlobalState

from .helpers import AOT_FAILS_INFERENCE_MODE, CountingCompiler
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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_uses(source: str) -> list[str]:
    """Private names reached in ``source``'s code (docstrings and comments do not count):
    imports of private torch modules, private attributes of anything but ``self``/``cls``
    (``torch._C``, ``_torch.some_module._x``, ``fp = _torch.x; fp._y``), and private names
    spelled as strings for getattr and friends."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [*node.module.split("."), *(a.name for a in node.names)]
            if any(map(_private, names)):
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and _root(node) not in ("self", "cls"):
            found.append(f"{node.lineno}: {_root(node)}...{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value))):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


@pytest.mark.parametrize("code", [
    "import torch._dynamo", "import torch.utils._pytree as pytree", "from torch._guards import TracingContext",
    "torch._C._set_grad_enabled(True)", "fp = _torch.predispatch\nfp._jvp_increment_nesting",
    "getattr(param, '_ddp_ignored', False)",
], ids=["import", "import-as", "from-import", "attribute", "alias", "getattr"])
def test_the_private_name_scan_catches(code: str) -> None:
    assert private_torch_uses(code), code


def test_no_module_but_the_door_names_private_torch_names() -> None:
    """Only ``_torch.py`` reaches private torch names; releases differ there and nowhere else."""
    package = pathlib.Path(ddp_split_backend.__file__).parent
    offenders = [f"{path.name}:{use}" for path in sorted(package.glob("*.py")) if path.name != "_torch.py"
                 for use in private_torch_uses(path.read_text())]
    assert not offenders, "\n".join(offenders)


def test_release_differences_are_recorded_with_what_handles_them() -> None:
    assert len(_torch.DIFFERENCES) >= 5
    for difference in _torch.DIFFERENCES:
        assert difference.what and difference.releases and difference.handled, difference


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0", "2.16.0.dev20261201+cu130", "3.0.0"])
def test_a_release_outside_the_range_fails_naming_the_range(version: str) -> None:
    with pytest.raises(_torch.UnsupportedTorchError, match=r"supports torch>=2\.11,<2\.16; this is torch " + re.escape(version)):
        _torch.check_release(version)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"])
def test_every_supported_release_passes_the_check(version: str) -> None:
    _torch.check_release(version)


def test_the_supported_range_is_the_one_pyproject_declares() -> None:
    pyproject = pathlib.Path(ddp_split_backend.__file__).parent.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("installed without its source tree")
    assert f'dependencies = ["{_torch.SUPPORTED}"]' in pyproject.read_text()


def test_on_inner_failure_raise_propagates_with_the_piece_named_and_state_restored() -> None:
    counting = CountingCompiler(fail_on={1})
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, bucket_cap_mb=0.015, on_inner_failure="raise"))
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
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, bucket_cap_mb=0.015))
    model = MLP(width=64, depth=3)
    x = torch.randn(2, 64)
    with pytest.warns(UserWarning, match="failed on piece 0 of 3"):
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    (record,) = backend.records
    assert [r.outcome for r in record.pieces] == [Outcome.EAGER_FALLBACK, Outcome.COMPILED, Outcome.COMPILED]
    failed = record.pieces[0]
    assert failed.error.exc_type == "RuntimeError" and "planned failure on piece 0" in failed.error.traceback
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
    for width in (3, 4, 5):  # recompiles (torch._dynamo.reset() would reset the backend too)
        torch.compile(nn.Linear(width, width), backend=backend, dynamic=False)(torch.randn(1, width))
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


@pytest.mark.expects_fallback(AOT_FAILS_INFERENCE_MODE)
@pytest.mark.parametrize("reuse", [False, True], ids=["no-reuse", "reuse"])
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_pieces_with_and_without_a_backward_match_eager(inner: str, reuse: bool) -> None:
    torch.manual_seed(0)
    model = GradModes()
    x = torch.randn(4, 64)
    expected = model(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=inner, bucket_cap_mb=0.015, reuse_identical_pieces=reuse))
    actual = torch.compile(model, backend=backend)(x)
    actual.sum().backward()
    (record,) = backend.records
    assert len(record.plan.buckets) == 5, record.plan.table()
    if reuse:  # sharing must happen, not silently stop
        shared = {r.piece: r.shared_with for r in record.pieces if r.outcome is Outcome.SHARED}
        assert shared == {4: 3}, shared  # the last two blocks are alike
    # Where AOTAutograd cannot compile inference_mode under autograd, the inference piece runs
    # eagerly and has no compiled backward.
    fell_back = {r.piece for r in record.pieces if r.outcome is Outcome.EAGER_FALLBACK}
    assert fell_back == (set() if _torch.aot_compiles_inference_mode_under_autograd() else {2})
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


@pytest.mark.expects_fallback(AOT_FAILS_INFERENCE_MODE)
def test_each_backward_compile_sees_its_own_pieces_metadata() -> None:
    """Backward reaches pieces 4, 3, 2 and 0 (not the no_grad piece 1), and each backward
    compile must be handed the forward metadata of that very piece."""
    witness = MetadataWitness()
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=witness, bucket_cap_mb=0.015))
    model = GradModes()
    torch.compile(model, backend=backend)(torch.randn(4, 64)).sum().backward()
    record = backend.records[-1]
    compiled = [r.piece for r in record.pieces if r.outcome is Outcome.COMPILED]
    assert compiled == ([0, 1, 2, 3, 4] if _torch.aot_compiles_inference_mode_under_autograd() else [0, 1, 3, 4])
    assert len(witness.forward) == len(compiled)
    names = {id(m): piece for piece, m in zip(compiled, witness.forward, strict=True)}
    reached = [p for p in (4, 3, 2, 0) if p in compiled]
    assert [names.get(id(m), "other") for m in witness.backward] == reached


def test_the_doors_all_names_every_public_name_it_defines() -> None:
    tree = ast.parse((pathlib.Path(_torch.__file__)).read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    assert sorted(_torch.__all__) == sorted(n for n in defined if not n.startswith("_"))
