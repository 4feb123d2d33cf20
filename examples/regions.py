"""A model whose forward mixes global-state regions, to look at how ddp_split cuts it::

    python -m ddp_split_backend explain examples.regions:build --input-shape 16,256 \\
        --bucket-cap-mb 0.3 --png docs/regions_plan.png
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Regions(nn.Module):
    def __init__(self, width: int = 256, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = iter(self.layers)
        x = torch.relu(next(layers)(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = torch.relu(next(layers)(x))
            x = torch.relu(next(layers)(x))
            with torch.autocast("cpu", enabled=False):
                x = torch.relu(next(layers)(x.float()))
        with torch.no_grad():
            scale = torch.sigmoid(next(layers)(x.float())).mean()
        with torch.inference_mode():
            bias = next(layers)(x).mean()
        x = torch.relu(next(layers)(x.float())) * scale + bias.clone()
        return next(layers)(x)


def build() -> Regions:
    torch.manual_seed(0)
    return Regions()
