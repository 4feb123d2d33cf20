"""The inner backend every piece is compiled with: a name or callable, and inductor's settings.

``mode`` and ``inner_options`` configure inductor per piece the way ``torch.compile(mode=...,
options=...)`` configures it for a whole graph: the mode's settings (``torch._inductor.
list_mode_options``) overlaid with the user's options are handed to inductor as config
patches, in force while the piece's forward compiles and, later, while its backward does.
They were checked when the :class:`~ddp_split_backend.SplitConfig` was built.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from . import _torch
from .compile import InnerCompile
from .config import SplitConfig

__all__ = ["inductor_patches", "inner_compile"]


def inductor_patches(mode: str | None, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The inductor config patches for ``mode`` overlaid with ``options``."""
    patches: dict[str, Any] = {}
    if mode is not None and mode != "default":
        patches.update(_torch.inductor_mode_options()(mode))
    patches.update(options or {})
    return patches


def inner_compile(config: SplitConfig) -> InnerCompile:
    """How each piece is compiled, as ``config`` says."""
    inner = config.inner
    raise_on_failure = config.on_inner_failure == "raise"
    if not isinstance(inner, str):
        return InnerCompile(inner, getattr(inner, "__name__", type(inner).__name__), raise_on_failure)
    fn = _torch.lookup_backend(inner)
    if config.mode is not None or config.inner_options:  # SplitConfig allows them for inductor only
        fn = functools.partial(fn, config_patches=inductor_patches(config.mode, config.inner_options))
    return InnerCompile(fn, inner, raise_on_failure)
