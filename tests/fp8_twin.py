"""The dequantised twin of ``linear_format: fp8``: a model whose FP8-shipped linears hold their FP8-rounded
weights in the model dtype (what the FP8 model computes with, decoded)."""

from dsv4.checkpoint.names import is_fp8_linear
from dsv4.kernels.fp8_linear import dequantize
from dsv4.model.linear_weights import quantize_linear
from dsv4.model.rows import Linear


def round_fp8_linears(model) -> int:
    """Round every FP8-shipped linear of ``model`` (plain weights) to FP8 in place; returns how many."""
    rounded = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and is_fp8_linear(name + ".weight"):
            q = quantize_linear(name + ".weight", m.weight)
            m.weight.copy_(dequantize(q[name + ".weight"], q[name + ".scale"], m.weight.dtype))
            rounded += 1
    return rounded
