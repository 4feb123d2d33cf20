"""Hugging Face accelerate + ddp_split: a small MLP, a few SGD steps, 2 CPU ranks (gloo).

Launch with torchrun (``accelerate launch`` starts the same processes)::

    torchrun --standalone --nproc_per_node=2 examples/launch_accelerate.py --out /tmp/acc.pt
    torchrun --standalone --nproc_per_node=2 examples/launch_accelerate.py --no-compile --out /tmp/acc_eager.pt

``Accelerator(dynamo_backend="ddp_split")`` and ``TorchDynamoPlugin(backend="ddp_split")``
raise ``ValueError: 'DDP_SPLIT' is not a valid DynamoBackend`` in accelerate 1.16: the plugin
only takes names in its ``DynamoBackend`` enum (and no callable). So the recipe compiles
the model ``accelerator.prepare`` returned: that is the DDP module, and compiling it is what
accelerate itself does with a backend it knows (``prepare_model`` wraps in DDP, then calls
``torch.compile`` "last").
"""

from __future__ import annotations

from ddp_split_backend.extras import missing

if problem := missing("accelerate", "examples/launch_accelerate.py"):
    raise SystemExit(problem)  # one line naming the extra to install

import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch.utils.data import DataLoader, TensorDataset

import ddp_split_backend
from ddp_split_backend import ddp_split


class MLP(nn.Module):
    # A module class of its own: Dynamo does not start a frame in torch.nn's code, so under
    # DDP (which graph-breaks before calling its module) a bare nn.Sequential compiles nothing.
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32 if i == 0 else width, width) for i in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result file (written by rank 0)")
    p.add_argument("--no-compile", action="store_true", help="plain DDP, for comparison")
    p.add_argument("--inner", default="inductor", help="backend ddp_split compiles each piece with")
    p.add_argument("--steps", type=int, default=8, help="training steps")
    p.add_argument("--bucket-cap-mb", type=float, default=0.02, help="DDP bucket cap (MiB)")
    args = p.parse_args()

    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=args.bucket_cap_mb)]
    )
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(256, 32, generator=data), torch.randint(0, 8, (256,), generator=data))
    loader = DataLoader(dataset, batch_size=8, shuffle=False)

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # model: DDP(MLP)
    if not args.no_compile:
        model = torch.compile(model, backend="ddp_split", options={"inner": args.inner})

    # Dynamo decides, as it compiles a frame, whether torch's DDPOptimizer cuts the graph
    # (optimize_ddp and an active DDP module, torch/_dynamo/convert_frame.py). The compiled
    # module is DDP, so without own_split() ddp_split would only see DDPOptimizer's pieces.
    losses = []
    with contextlib.nullcontext() if args.no_compile else ddp_split_backend.own_split():
        for step, (x, y) in zip(range(args.steps), loader):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(accelerator.gather(loss.detach()).mean().item())

    plans = [r.plan for r in ddp_split.records]
    if accelerator.is_main_process:
        for plan in plans:
            print(plan.table(), flush=True)
        print("losses:", " ".join(f"{v:.4f}" for v in losses), flush=True)
        state = accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()
        torch.save({
            "params": {n: t.detach().clone() for n, t in state.items()},
            "losses": losses,
            "plans": [(plan.source, len(plan.pieces)) for plan in plans],
        }, args.out)
    # Reducers first, then the process group: Note [Teardown deadlock] (ddp_split_backend/teardown.py).
    ddp_split_backend.close_ddp(model)


if __name__ == "__main__":
    main()
