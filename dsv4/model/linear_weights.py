"""The FP8-shipped linears' weights in one of two formats (the engine's ``linear_format``):

* ``dequantized`` (the default): every linear a parameter in the model's dtype (a checkpoint's FP8 decoded at
  load);
* ``fp8``: the linears DeepSeek ships as FP8 (``names.is_fp8_linear``: attention, indexer query, shared
  expert, MTP projections) kept as e4m3 values with a float32 power-of-two scale per 128x128 block (state-dict
  names ``X.weight`` and ``X.scale``): half the bytes of bf16. ``Linear`` multiplies them weight-only
  (``dsv4.kernels.fp8_linear``); the products are those of the dequantised weights. The other linears (head,
  compressors, the indexer's weights_proj, the router) stay in the model dtype, as the checkpoint has them.

A checkpoint's FP8 weights are decoded at read and quantised again here; with power-of-two (e8m0) scales, as
DeepSeek ships them, the two are exact inverses (see ``quantize_linear``), so nothing is rounded twice. A preset's random weights are
rounded to FP8.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.names import is_fp8_linear
from ..checkpoint.quant import e8m0_to_float, quant_fp8_block
from .rows import Linear

LINEAR_FORMATS = ("dequantized", "fp8")
WEIGHT, SCALE = ".weight", ".scale"


def scale_key(weight_name: str) -> str:
    return weight_name[: -len(WEIGHT)] + SCALE


def quantize_linear(name: str, t: torch.Tensor) -> dict:
    """{name: t}, or for an FP8-shipped linear its e4m3 values and its float32 block scales. Values that are an
    FP8 weight already (decoded at read) come back unchanged: the scale is the smallest power of two that
    holds the block's largest value, at most the file's own, so every value stays an e4m3 value times it."""
    if not is_fp8_linear(name) or t.dim() != 2:
        return {name: t}
    q, scale = quant_fp8_block(t)
    return {name: q, scale_key(name): e8m0_to_float(scale)}


def quantize_linears(state_dict: dict) -> dict:
    """``quantize_linear`` over a model-named state dict, one tensor at a time (its dequantised form released
    as it goes)."""
    out = {}
    for name in list(state_dict):
        out.update(quantize_linear(name, state_dict.pop(name)))
    return out


def adopt_linear_layout(model: nn.Module, state_dict: dict) -> None:
    """Before ``load_state_dict``: every linear whose scale the state dict holds switches to the FP8 layout."""
    for name, m in model.named_modules():
        if isinstance(m, Linear) and f"{name}{SCALE}" in state_dict:
            m.use_fp8()
