"""Command line: ``python -m ddp_split_backend explain module:factory --input-shape 8,1000``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import torch

from .explain import explain
from .extras import missing


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-shape {text!r}: expected integers like 8,1000") from None


def _min_piece(text: str) -> float | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--min-piece-mb {text!r}: expected 'auto', 'none' or MiB") from None


def _load(spec: str) -> torch.nn.Module:
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"model {spec!r}: expected module:factory, e.g. mypkg.models:build")
    factory = getattr(importlib.import_module(module_name), attr)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_split_backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print (and draw) the split plan of a model")
    ex.add_argument("model", help="module:factory returning an nn.Module, e.g. mypkg.models:build")
    ex.add_argument("--input-shape", type=_shape, action="append", required=True,
                    help="shape of one input, e.g. 8,1000; repeat for several inputs")
    ex.add_argument("--input-dtype", default="float32", help="dtype of the inputs (e.g. int64 for tokens)")
    ex.add_argument("--high", type=int, default=2, help="exclusive upper bound for integer inputs")
    ex.add_argument("--bucket-cap-mb", type=float, default=None)
    ex.add_argument("--first-bucket-cap-mb", type=float, default=None)
    ex.add_argument("--min-piece-mb", type=_min_piece, default=None,
                    help="'none' (default: one piece per bucket), a size in MiB, or 'auto' "
                         "(grouped by predicted cost, as if under DDP)")
    ex.add_argument("--link-gbps", type=float, default=None, help="with auto: the link's speed in GB/s")
    ex.add_argument("--png", default=None, help="also draw the plan into this PNG file")
    args = parser.parse_args(argv)
    if args.png and (problem := missing("matplotlib", "--png")):
        sys.stderr.write(problem + "\n")
        return 2

    sys.path.insert(0, ".")
    model = _load(args.model)
    dtype = getattr(torch, args.input_dtype)
    inputs = [
        torch.randint(0, args.high, shape) if not dtype.is_floating_point else torch.randn(shape, dtype=dtype)
        for shape in args.input_shape
    ]
    options = {k: v for k, v in (("bucket_cap_mb", args.bucket_cap_mb),
                                 ("first_bucket_cap_mb", args.first_bucket_cap_mb),
                                 ("link_gbps", args.link_gbps)) if v is not None}
    options["min_piece_mb"] = args.min_piece_mb
    result = explain(model, *inputs, **options)
    sys.stdout.write(result.table() + "\n")
    if args.png:
        sys.stdout.write(f"wrote {result.render_png(args.png)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
