"""Golden piece code: the prologue/epilogue the split writes, for the canonical cases.

A change to how pieces re-create global state shows here as a readable diff. After an
intended change, regenerate with ``EXPECTTEST_ACCEPT=1 .venv/bin/python -m pytest
tests/test_golden.py`` and review the diff.
"""

from __future__ import annotations

import re

import expecttest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn

from ddp_split_backend import SplitConfig, _torch, plan_split
from ddp_split_backend.layout import layout_graph
from ddp_split_backend.split import split_graph
from ddp_split_backend.state import Ambient


class Four(nn.Module):
    """Four Linear(8) layers; ``region`` wraps the middle two."""

    def __init__(self, region: str) -> None:
        super().__init__()
        self.region = region
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def _middle(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[2](self.layers[1](x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if self.region == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self._middle(x)
            x = x.float()
        elif self.region == "inference":
            with torch.inference_mode():
                x = self._middle(x)
            x = x.clone()
        elif self.region == "dual":
            with fwAD.dual_level():
                d = fwAD.make_dual(x, torch.ones_like(x))
                p, t = fwAD.unpack_dual(torch.sin(d))
                x = self._middle(p + t)
        elif self.region == "no_grad_in_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with torch.no_grad():
                    x = self._middle(x)
            x = x.float()
        return self.layers[3](x)


def _piece_code(region: str) -> str:
    graphs: list = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Four(region), backend=capture)(torch.randn(2, 8))
    (gm, example_inputs), = graphs
    config = SplitConfig(min_piece_mb=None, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002)
    plan = plan_split(gm, example_inputs, config=config)
    split = split_graph(gm, layout_graph(gm, Ambient.capture()), plan.cuts)
    text = "\n".join(f"# piece {p.index} (grad={p.grad})\n{p.gm.code.strip()}" for p in split.pieces)
    text = re.sub(r"l_self_modules_layers_modules_(\d)_parameters_", r"L\1_", text)  # shorter names
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


class GoldenPieces(expecttest.TestCase):
    def test_autocast_across_a_cut(self) -> None:
        self.assertExpectedInline(_piece_code("autocast"), """\
# piece 0 (grad=True)
def forward(self, l_x_ : torch.Tensor, L0_bias_ : torch.nn.parameter.Parameter, L0_weight_ : torch.nn.parameter.Parameter):
    x = torch._C._nn.linear(l_x_, L0_weight_, L0_bias_);  l_x_ = L0_weight_ = L0_bias_ = None
    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
    return (x,)
# piece 1 (grad=True)
def forward(self, x, L1_bias_ : torch.nn.parameter.Parameter, L1_weight_ : torch.nn.parameter.Parameter):
    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
    linear_1 = torch._C._nn.linear(x, L1_weight_, L1_bias_);  x = L1_weight_ = L1_bias_ = None
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
    return (linear_1,)
# piece 2 (grad=True)
def forward(self, linear_1, L2_bias_ : torch.nn.parameter.Parameter, L2_weight_ : torch.nn.parameter.Parameter):
    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
    x_1 = torch._C._nn.linear(linear_1, L2_weight_, L2_bias_);  linear_1 = L2_weight_ = L2_bias_ = None
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
    x_2 = x_1.float();  x_1 = None
    return (x_2,)
# piece 3 (grad=True)
def forward(self, x_2, L3_bias_ : torch.nn.parameter.Parameter, L3_weight_ : torch.nn.parameter.Parameter):
    linear_3 = torch._C._nn.linear(x_2, L3_weight_, L3_bias_);  x_2 = L3_weight_ = L3_bias_ = None
    return (linear_3,)""")

    def test_inference_mode_across_a_cut(self) -> None:
        self.assertExpectedInline(_piece_code("inference"), """\
# piece 0 (grad=True)
def forward(self, l_x_ : torch.Tensor, L0_bias_ : torch.nn.parameter.Parameter, L0_weight_ : torch.nn.parameter.Parameter):
    x = torch._C._nn.linear(l_x_, L0_weight_, L0_bias_);  l_x_ = L0_weight_ = L0_bias_ = None
    _enter_inference_mode = torch.autograd.grad_mode._enter_inference_mode(True)
    _exit_inference_mode = torch.autograd.grad_mode._exit_inference_mode(_enter_inference_mode);  _enter_inference_mode = _exit_inference_mode = None
    return (x,)
# piece 1 (grad=False)
def forward(self, x, L1_bias_ : torch.nn.parameter.Parameter, L1_weight_ : torch.nn.parameter.Parameter):
    _set_grad_enabled = torch._C._set_grad_enabled(True);  _set_grad_enabled = None
    _enter_inference_mode = torch.autograd.grad_mode._enter_inference_mode(True)
    linear_1 = torch._C._nn.linear(x, L1_weight_, L1_bias_);  x = L1_weight_ = L1_bias_ = None
    _exit_inference_mode = torch.autograd.grad_mode._exit_inference_mode(_enter_inference_mode);  _enter_inference_mode = _exit_inference_mode = None
    _set_grad_enabled_1 = torch._C._set_grad_enabled(False);  _set_grad_enabled_1 = None
    return (linear_1,)
# piece 2 (grad=True)
def forward(self, linear_1, L2_bias_ : torch.nn.parameter.Parameter, L2_weight_ : torch.nn.parameter.Parameter):
    _enter_inference_mode = torch.autograd.grad_mode._enter_inference_mode(True)
    x_1 = torch._C._nn.linear(linear_1, L2_weight_, L2_bias_);  linear_1 = L2_weight_ = L2_bias_ = None
    _exit_inference_mode = torch.autograd.grad_mode._exit_inference_mode(_enter_inference_mode);  _enter_inference_mode = _exit_inference_mode = None
    x_2 = x_1.clone();  x_1 = None
    return (x_2,)
# piece 3 (grad=True)
def forward(self, x_2, L3_bias_ : torch.nn.parameter.Parameter, L3_weight_ : torch.nn.parameter.Parameter):
    linear_3 = torch._C._nn.linear(x_2, L3_weight_, L3_bias_);  x_2 = L3_weight_ = L3_bias_ = None
    return (linear_3,)""")

    def test_dual_level_across_a_cut(self) -> None:
        code = _piece_code("dual")
        if _torch.enter_dual_level is _torch.c_enter_dual_level:  # how 2.11 and 2.12 record it
            self.assertExpectedInline(code, """\
# piece 0 (grad=True)
def forward(self, l_x_ : torch.Tensor, L0_bias_ : torch.nn.parameter.Parameter, L0_weight_ : torch.nn.parameter.Parameter):
    x = torch._C._nn.linear(l_x_, L0_weight_, L0_bias_);  l_x_ = L0_weight_ = L0_bias_ = None
    _enter_dual_level = torch._C._enter_dual_level();  _enter_dual_level = None
    ones_like = torch.ones_like(x)
    _maybe_load_decompositions = torch.autograd.forward_ad._maybe_load_decompositions();  _maybe_load_decompositions = None
    d = torch._make_dual(x, ones_like, level = 0);  x = ones_like = None
    sin = torch.sin(d);  d = None
    _unpack_dual = torch._unpack_dual(sin, level = 0);  sin = None
    primal = _unpack_dual[0]
    dual = _unpack_dual[1];  _unpack_dual = None
    add = primal + dual;  primal = dual = None
    _exit_dual_level = torch._C._exit_dual_level(level = 0);  _exit_dual_level = None
    return (add,)
# piece 1 (grad=True)
def forward(self, add, L1_bias_ : torch.nn.parameter.Parameter, L1_weight_ : torch.nn.parameter.Parameter):
    _enter_dual_level = torch._C._enter_dual_level();  _enter_dual_level = None
    linear_1 = torch._C._nn.linear(add, L1_weight_, L1_bias_);  add = L1_weight_ = L1_bias_ = None
    _exit_dual_level = torch._C._exit_dual_level(level = 0);  _exit_dual_level = None
    return (linear_1,)
# piece 2 (grad=True)
def forward(self, linear_1, L2_bias_ : torch.nn.parameter.Parameter, L2_weight_ : torch.nn.parameter.Parameter):
    _enter_dual_level = torch._C._enter_dual_level();  _enter_dual_level = None
    x_1 = torch._C._nn.linear(linear_1, L2_weight_, L2_bias_);  linear_1 = L2_weight_ = L2_bias_ = None
    _exit_dual_level = torch._C._exit_dual_level(0);  _exit_dual_level = None
    return (x_1,)
# piece 3 (grad=True)
def forward(self, x_1, L3_bias_ : torch.nn.parameter.Parameter, L3_weight_ : torch.nn.parameter.Parameter):
    linear_3 = torch._C._nn.linear(x_1, L3_weight_, L3_bias_);  x_1 = L3_weight_ = L3_bias_ = None
    return (linear_3,)""")
            return
        self.assertExpectedInline(code, """\
# piece 0 (grad=True)
def forward(self, l_x_ : torch.Tensor, L0_bias_ : torch.nn.parameter.Parameter, L0_weight_ : torch.nn.parameter.Parameter):
    x = torch._C._nn.linear(l_x_, L0_weight_, L0_bias_);  l_x_ = L0_weight_ = L0_bias_ = None
    _enter_dual_level = torch._functorch.predispatch._enter_dual_level();  _enter_dual_level = None
    ones_like = torch.ones_like(x)
    _maybe_load_decompositions = torch.autograd.forward_ad._maybe_load_decompositions();  _maybe_load_decompositions = None
    d = torch._functorch.predispatch._make_dual(x, ones_like, level = 0);  x = ones_like = None
    sin = torch.sin(d);  d = None
    _unpack_dual = torch._functorch.predispatch._unpack_dual(sin, level = 0);  sin = None
    primal = _unpack_dual[0]
    dual = _unpack_dual[1];  _unpack_dual = None
    add = primal + dual;  primal = dual = None
    _exit_dual_level = torch._functorch.predispatch._exit_dual_level(level = 0);  _exit_dual_level = None
    return (add,)
# piece 1 (grad=True)
def forward(self, add, L1_bias_ : torch.nn.parameter.Parameter, L1_weight_ : torch.nn.parameter.Parameter):
    _enter_dual_level = torch._functorch.predispatch._enter_dual_level();  _enter_dual_level = None
    linear_1 = torch._C._nn.linear(add, L1_weight_, L1_bias_);  add = L1_weight_ = L1_bias_ = None
    _exit_dual_level = torch._functorch.predispatch._exit_dual_level(level = 0);  _exit_dual_level = None
    return (linear_1,)
# piece 2 (grad=True)
def forward(self, linear_1, L2_bias_ : torch.nn.parameter.Parameter, L2_weight_ : torch.nn.parameter.Parameter):
    _enter_dual_level = torch._functorch.predispatch._enter_dual_level();  _enter_dual_level = None
    x_1 = torch._C._nn.linear(linear_1, L2_weight_, L2_bias_);  linear_1 = L2_weight_ = L2_bias_ = None
    _exit_dual_level = torch._functorch.predispatch._exit_dual_level(level = 0);  _exit_dual_level = None
    return (x_1,)
# piece 3 (grad=True)
def forward(self, x_1, L3_bias_ : torch.nn.parameter.Parameter, L3_weight_ : torch.nn.parameter.Parameter):
    linear_3 = torch._C._nn.linear(x_1, L3_weight_, L3_bias_);  x_1 = L3_weight_ = L3_bias_ = None
    return (linear_3,)""")

    def test_grad_mode_inside_autocast_across_a_cut(self) -> None:
        self.assertExpectedInline(_piece_code("no_grad_in_autocast"), """\
# piece 0 (grad=True)
def forward(self, l_x_ : torch.Tensor, L0_bias_ : torch.nn.parameter.Parameter, L0_weight_ : torch.nn.parameter.Parameter):
    x = torch._C._nn.linear(l_x_, L0_weight_, L0_bias_);  l_x_ = L0_weight_ = L0_bias_ = None
    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
    _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
    _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
    return (x,)
# piece 1 (grad=False)
def forward(self, x, L1_bias_ : torch.nn.parameter.Parameter, L1_weight_ : torch.nn.parameter.Parameter):
    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
    linear_1 = torch._C._nn.linear(x, L1_weight_, L1_bias_);  x = L1_weight_ = L1_bias_ = None
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
    return (linear_1,)
# piece 2 (grad=True)
def forward(self, linear_1, L2_bias_ : torch.nn.parameter.Parameter, L2_weight_ : torch.nn.parameter.Parameter):
    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
    _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
    x_1 = torch._C._nn.linear(linear_1, L2_weight_, L2_bias_);  linear_1 = L2_weight_ = L2_bias_ = None
    _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
    x_2 = x_1.float();  x_1 = None
    return (x_2,)
# piece 3 (grad=True)
def forward(self, x_2, L3_bias_ : torch.nn.parameter.Parameter, L3_weight_ : torch.nn.parameter.Parameter):
    linear_3 = torch._C._nn.linear(x_2, L3_weight_, L3_bias_);  x_2 = L3_weight_ = L3_bias_ = None
    return (linear_3,)""")
