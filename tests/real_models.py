"""Tiny-config models from the libraries users train with, trained under DDP both ways.

Every model is built from a config (no weights are downloaded): Hugging Face
``transformers`` GPT-2 (tied embeddings), Llama (RMSNorm, rotary, SDPA, grouped KV heads) and
BERT masked-LM; ``timm`` ViT; ``torchvision`` ResNet-18 (BatchNorm buffers). Each case
trains a model with eager DDP and, from the same weights on the same per-rank data, through
the path users take: ``backend="ddp_split"`` by name, the inner backend by name, default
options (a piece per bucket, identical pieces shared), under
:func:`ddp_split_backend.own_split`. The opt-in ``min_piece_mb="auto"``: ``tests/test_auto_pieces.py``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .helpers import piece_bucket_agreement
from .torchvision_cpu import define_torchvision_operators

define_torchvision_operators()  # before transformers, timm or torchvision is imported

__all__ = ["MODELS", "MORE_MODELS", "RealCase", "CASES", "RUN", "run_real_cases", "why_not_run"]

VOCAB = 64
SEQ = 16
BATCH = 2
IMAGES = 8  # BatchNorm over >= 32 values per channel in ResNet-18's last stage


def _tokens(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _images(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(IMAGES, 3, 64, 64, generator=gen), "y": torch.randint(0, 10, (IMAGES,), generator=gen)}


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _vision_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]).float(), batch["y"])


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        num_local_experts=4, num_experts_per_tok=2, attn_implementation="sdpa",
    )
    return MixtralForCausalLM(config)


def vit() -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=16, embed_dim=32,
        depth=3, num_heads=2, num_classes=10,
    )


def resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=10)


@dataclass(frozen=True, slots=True)
class RealModel:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    lr: float = 0.01


MODELS: dict[str, RealModel] = {
    "gpt2": RealModel(gpt2, _tokens, _hf_loss),
    "llama": RealModel(llama, _tokens, _hf_loss),
    "bert": RealModel(bert, _tokens, _hf_loss),
    "vit": RealModel(vit, _images, _vision_loss),
    # BatchNorm over few values per channel amplifies any reordering of float work: plain
    # torch.compile(backend="inductor") of this ResNet, no DDP, ends 2e-3 away from eager
    # after 3 SGD steps at lr 0.01. At lr 1e-3 both stay within inductor's tolerance.
    "resnet18": RealModel(resnet18, _images, _vision_loss, lr=1e-3),
}


@dataclass(frozen=True, slots=True)
class RealCase:
    """One training run: a model, the inner backend, the wrapping order, precision and cap."""

    model: str
    inner: str
    wrap: str  # "outside": torch.compile(DDP(m)); "inside": DDP(torch.compile(m))
    amp: bool  # bf16 autocast around forward
    cap: str  # "several": the model in ~4 buckets; "small": ~8 buckets and below 1 MiB

    @property
    def id(self) -> str:
        return f"{self.model}-{self.inner}-{self.wrap}-{'bf16' if self.amp else 'fp32'}-{self.cap}"


MORE_MODELS: dict[str, RealModel] = {
    "t5": RealModel(t5, _tokens, _hf_loss),
    "mixtral": RealModel(mixtral, _tokens, _hf_loss),
}
"""Models only the bucket test trains (tests/test_ddp_buckets.py), not the matrix above."""

LIBRARY = {"gpt2": "transformers", "llama": "transformers", "bert": "transformers", "vit": "timm",
           "resnet18": "torchvision", "t5": "transformers", "mixtral": "transformers"}
"""The library each model is built from."""
SELECT_ENV = "DDP_SPLIT_REAL_MODELS"
"""Comma-separated model names to run (the torch matrix runs ``gpt2,llama``); unset: all."""


def why_not_run(model: str) -> str | None:
    """Why ``model`` is left out of this run (not selected, or its library missing), or None."""
    selected = os.environ.get(SELECT_ENV)
    if selected and model not in selected.split(","):
        return f"{SELECT_ENV}={selected} leaves {model} out"
    library = LIBRARY[model]
    if importlib.util.find_spec(library) is None:
        return f"{library} is not installed beside this torch (no release of it pairs with torch {torch.__version__})"
    return None


BUCKET_TEST_MODELS = ("gpt2", "llama", "vit", "resnet18")
"""Models ``tests/test_ddp_buckets.py`` trains 10 steps with aot_eager, outside, fp32, at the
``several`` cap against eager DDP (``tests/bucket_cases.py``): that case is not repeated here."""


def _cases() -> list[RealCase]:
    """Per model: aot_eager with each wrapping order, precision and cap, and inductor under
    bf16 autocast (``inductor-inside-fp32-small`` was dropped on 2026-12-07 to keep the
    default suite near 10 minutes: each of its parts is in another case; so was
    ``aot_eager-outside-fp32-several`` for the models of :data:`BUCKET_TEST_MODELS`)."""
    cases = []
    for model in MODELS:
        if model not in BUCKET_TEST_MODELS:
            cases.append(RealCase(model, "aot_eager", "outside", False, "several"))
        cases.append(RealCase(model, "aot_eager", "inside", True, "small"))
        cases.append(RealCase(model, "inductor", "outside", True, "several"))
    return cases


CASES = _cases()
RUN = [case for case in CASES if why_not_run(case.model) is None]
"""The cases this run trains."""
STEPS = 3


def cap_mb(model: nn.Module, cap: str) -> float:
    total = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return total / 4 if cap == "several" else min(0.9, total / 8)


def _train(model: nn.Module, loss_fn: Callable, batches: list[dict], amp: bool, lr: float) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            loss = loss_fn(model, batch)
        loss.float().backward()
        losses.append(loss.detach().float())
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        opt.step()
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


def run_real_case(rank: int, case: RealCase) -> dict[str, Any]:
    import ddp_split_backend
    from ddp_split_backend import ddp_split

    torch._dynamo.reset()
    spec = MODELS[case.model]
    torch.manual_seed(0)
    base = spec.build()
    cap = cap_mb(base, case.cap)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank trains on its own data
    batches = [spec.batch(gen) for _ in range(STEPS)]

    eager = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    expected = _train(eager, spec.loss, batches, case.amp, spec.lr)
    reference64 = None
    if case.inner == "inductor" or case.amp:  # torch's accuracy check measures both against float64
        batches64 = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
        eager64 = DDP(copy.deepcopy(base).double(), bucket_cap_mb=cap)
        reference64 = _train(eager64, spec.loss, batches64, case.amp, spec.lr)

    options = {"inner": case.inner}  # the defaults: a piece per bucket
    if case.wrap == "outside":
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
        model: nn.Module = torch.compile(ddp, backend="ddp_split", options=options)
    else:
        ddp = DDP(torch.compile(copy.deepcopy(base), backend="ddp_split", options=options), bucket_cap_mb=cap)
        model = ddp
    ddp_split.records.clear()
    start = time.perf_counter()
    with ddp_split_backend.own_split():
        actual = _train(model, spec.loss, batches, case.amp, spec.lr)
    seconds = time.perf_counter() - start
    matched, param_pieces, spans = piece_bucket_agreement(ddp, [r.plan for r in ddp_split.records])
    return {
        "names": [n for n, _ in base.named_parameters()],
        "expected": expected,
        "reference64": reference64,
        "actual": actual,
        "cap_mb": cap,
        "graphs": len(ddp_split.records),
        "pieces": [len(r.plan.buckets) for r in ddp_split.records],
        "sources": [r.plan.source for r in ddp_split.records],
        "outcomes": [p.outcome for r in ddp_split.records for p in r.pieces],
        "compiled_by": [c for r in ddp_split.records for c in r.compiled_by],
        "matched": matched,
        "param_pieces": param_pieces,
        "buckets": len(spans),
        "spans": spans,
        "seconds": seconds,
    }


def run_real_cases(rank: int, world: int, cases: list[RealCase]) -> dict[str, dict[str, Any]]:
    return {case.id: run_real_case(rank, case) for case in cases}
