"""Hugging Face ``Trainer`` + ddp_split: a tiny GPT-2 built from its config, 2 CPU ranks (gloo).

Launch with torchrun::

    torchrun --standalone --nproc_per_node=2 examples/launch_hf_trainer.py --out /tmp/hf.pt
    torchrun --standalone --nproc_per_node=2 examples/launch_hf_trainer.py --no-compile --out /tmp/hf_eager.pt

``TrainingArguments(torch_compile=True, torch_compile_backend="ddp_split")`` cannot be used
with accelerate 1.16: ``Trainer`` hands the backend name to accelerate's
``TorchDynamoPlugin``, which only takes members of its ``DynamoBackend`` enum and raises
``ValueError: 'DDP_SPLIT' is not a valid DynamoBackend``. So the recipe leaves
``torch_compile`` off and compiles in ``training_step``, whose ``model`` is the DDP module
accelerate made (``DistributedDataParallel`` first, ``torch.compile`` around it: the order
accelerate uses too). Nothing is downloaded; no checkpoint is written.
"""

from __future__ import annotations

from ddp_split_backend.extras import missing

if problem := missing("transformers", "examples/launch_hf_trainer.py"):
    raise SystemExit(problem)  # one line naming the extra to install

import argparse
import contextlib
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ddp_split_backend
from ddp_split_backend import ddp_split


class DDPSplitTrainer(Trainer):
    """``Trainer`` whose training forward runs ``torch.compile(DDP(model), backend="ddp_split")``."""

    def __init__(self, *args, compile_options: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compile_options = compile_options
        self._compiled: torch.nn.Module | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        # ``model`` is Trainer's ``model_wrapped``: the DDP module ``accelerator.prepare`` built.
        if self._compiled is None or self._compiled._orig_mod is not model:
            self._compiled = torch.compile(model, backend="ddp_split", options=self.compile_options)
        return super().training_step(self._compiled, inputs, num_items_in_batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result file (written by rank 0)")
    p.add_argument("--no-compile", action="store_true", help="plain DDP, for comparison")
    p.add_argument("--inner", default="inductor", help="backend ddp_split compiles each piece with")
    p.add_argument("--steps", type=int, default=8, help="training steps")
    p.add_argument("--bucket-cap-mb", type=float, default=0.1, help="DDP bucket cap (MiB)")
    args = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    data = torch.randint(0, config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in data]

    training_args = TrainingArguments(
        output_dir=str(Path(args.out).resolve().parent / "hf_output"),  # stays empty: nothing is saved
        max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, seed=0, use_cpu=True, ddp_backend="gloo",
        ddp_bucket_cap_mb=args.bucket_cap_mb, ddp_find_unused_parameters=False,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    if args.no_compile:
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    else:
        trainer = DDPSplitTrainer(model=model, args=training_args, train_dataset=dataset,
                                  compile_options={"inner": args.inner})

    # Dynamo decides per compiled frame, when it compiles, whether torch's DDPOptimizer cuts
    # the graph (torch/_dynamo/convert_frame.py: optimize_ddp and an active DDP module). DDP
    # is active during every Trainer forward, so without this ddp_split would only compile
    # DDPOptimizer's pieces whole. own_split() turns optimize_ddp off for the loop only.
    with contextlib.nullcontext() if args.no_compile else ddp_split_backend.own_split():
        trainer.train()

    rank = trainer.args.process_index
    plans = [r.plan for r in ddp_split.records]
    if rank == 0:
        for plan in plans:
            print(plan.table(), flush=True)
        torch.save({
            "params": {n: t.detach().clone() for n, t in model.named_parameters()},
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "plans": [(plan.source, len(plan.pieces)) for plan in plans],
        }, args.out)
    # Reducers first, then the process group: Note [Teardown deadlock] (ddp_split_backend/teardown.py).
    ddp_split_backend.close_ddp(trainer.model_wrapped)


if __name__ == "__main__":
    main()
