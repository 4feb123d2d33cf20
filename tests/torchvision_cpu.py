"""Make torchvision's pure-Python code importable beside the CPU build of torch 2.13.

The torchvision release paired with torch 2.13 (0.28.0) exists on PyPI only as a CUDA
build: its C++ extension links ``libtorch_cuda.so`` and cannot load beside the CPU wheel,
and then ``import torchvision`` fails in ``torchvision/_meta_registrations.py``, which
registers fake kernels for operators (``torchvision::nms``, ``roi_align``, ...) that only the
extension defines. ``timm`` imports torchvision unconditionally, and ``transformers``
imports it whenever it is installed, so without this neither library imports at all.

:func:`define_torchvision_operators` declares those operators' schemas (as the extension
would) so the import succeeds. Nothing here implements an operator: calling one raises
"no kernel". The model families the tests use (ResNet, and timm's ViT/ResNet that import
torchvision for ``FrozenBatchNorm2d`` and transforms) never call them. Call it before the
first ``import torchvision``; it does nothing where the real extension has loaded.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch

__all__ = ["define_torchvision_operators"]

# The schemas of the operators torchvision's Python code registers fake kernels for.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, "
    "float rois_scale, int rois_zero_point, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, "
    "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
    "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
    "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)

_library: torch.library.Library | None = None


def _defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
    except RuntimeError:
        return False
    return True


def _load_extension() -> bool:
    """Load torchvision's own extension where it can load (beside a CUDA build of torch)."""
    spec = importlib.util.find_spec("torchvision")
    for folder in spec.submodule_search_locations or () if spec else ():
        for library in pathlib.Path(folder).glob("_C*.so"):
            try:
                torch.ops.load_library(str(library))
            except (OSError, RuntimeError):
                return False
            return True
    return False


def define_torchvision_operators() -> None:
    """Declare torchvision's operator schemas unless its extension already did (idempotent)."""
    global _library
    if _library is not None or importlib.util.find_spec("torchvision") is None:
        return
    if _defined("torchvision::nms") or _load_extension():
        return  # the real extension is loaded
    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)
