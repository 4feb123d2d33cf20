"""Small user-defined models for the tests (Dynamo skips bare nn.Sequential under DDP)."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, d_in: int | None = None, d_out: int | None = None) -> None:
        super().__init__()
        sizes = [d_in or width] + [width] * (depth - 1) + [d_out or width]
        self.net = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = torch.relu(layer(x))
        return x


class TanhStack(nn.Module):
    """``depth`` x (Linear(width, width) + tanh). At width 512 a weight is 1 MiB, so with
    ``bucket_cap_mb=1`` DDP gives every layer its own bucket."""

    def __init__(self, width: int = 512, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class CheckpointedTanhStack(TanhStack):
    """:class:`TanhStack` whose middle layers (all but the first and the last) run inside one
    non-reentrant activation checkpoint."""

    def _middle(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[1:-1]:
            x = torch.tanh(layer(x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        x = torch.utils.checkpoint.checkpoint(self._middle, x, use_reentrant=False)
        return torch.tanh(self.layers[-1](x))


class TiedLM(nn.Module):
    """Embedding tied to the output head: one parameter used first and last."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


class StateRegions(nn.Module):
    """Every state kind Dynamo emits, each region holding layers so cuts can fall inside."""

    def __init__(self, width: int = 32, kind: str = "grad") -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(6)])

    def _stack(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        for layer in self.layers[lo:hi]:
            x = torch.tanh(layer(x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._stack(x, 0, 1)
        if self.kind == "grad":
            with torch.no_grad():
                frozen = self._stack(x, 1, 4)
            x = x + frozen
        elif self.kind == "enable_grad":
            with torch.no_grad():
                with torch.enable_grad():
                    x = self._stack(x, 1, 4)
        elif self.kind == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self._stack(x, 1, 3)
                with torch.autocast("cpu", enabled=False):
                    x = self._stack(x.float(), 3, 4)
                x = x * 2
            x = x.float()
        elif self.kind == "autocast_fp16":
            with torch.autocast("cpu", dtype=torch.float16):
                x = self._stack(x, 1, 4)
            x = x.float()
        elif self.kind == "inference":
            with torch.inference_mode():
                side = self._stack(x, 1, 4)
            x = x + side.clone()
        elif self.kind == "dual":
            with fwAD.dual_level():
                dual = fwAD.make_dual(x, torch.ones_like(x))
                tangent = fwAD.unpack_dual(torch.sin(dual)).tangent
                x = self._stack(x, 1, 4) + tangent
        elif self.kind == "fwd_grad_off":
            with fwAD._set_fwd_grad_enabled(False):
                x = self._stack(x, 1, 4)
        return self._stack(x, 4, 6)


class WithBatchNorm(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, width)
        self.bn2 = nn.BatchNorm1d(width)
        self.c = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.a(x)))
        x = F.relu(self.bn2(self.b(x)))
        return self.c(x)


class EncoderBlock(nn.Module):
    """A new user's transformer (issue 31): two encoder layers under bf16 autocast, a head."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.encoder(x)
        return self.head(x.float().mean(1))


class ConvNet(nn.Module):
    """A new user's BatchNorm CNN (issue 31): four Conv2d + BatchNorm2d, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3 if i == 0 else 16, 16, 3, padding=1) for i in range(4)])
        self.norms = nn.ModuleList([nn.BatchNorm2d(16) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = torch.relu(norm(conv(x)))
        return self.head(x.mean((2, 3)))
