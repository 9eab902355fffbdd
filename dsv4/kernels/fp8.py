"""FP8 (e4m3) rows with one float32 scale per 64 values: the KV cache's FP8 format. Plain torch; the attention
kernels decode the same format in place (``sparse_attention``), and these functions are their twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 64


def num_scale_blocks(width: int) -> int:
    return -(-width // FP8_BLOCK)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (fp8 values [N, D], float32 scale [N, ceil(D/64)]), amax-scaled per 64-value block."""
    N, D = x.shape
    nb = num_scale_blocks(D)
    xp = F.pad(x.float(), (0, nb * FP8_BLOCK - D)).view(N, nb, FP8_BLOCK)
    # amax / 448 rounded once, with a tensor divisor (a fill, safe in a graph capture): torch's CUDA division by
    # a Python scalar multiplies by its float32 reciprocal (an ulp off in half the cases); the CPU and the
    # norm-rope kernel's FP8 store divide
    amax = xp.abs().amax(-1)
    scale = amax / amax.new_full((), FP8_MAX)                                   # [N, nb]
    q = (xp / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8).view(N, nb * FP8_BLOCK)[:, :D].contiguous(), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, D = q.shape
    nb = scale.shape[-1]
    x = F.pad(q.float(), (0, nb * FP8_BLOCK - D)).view(N, nb, FP8_BLOCK) * scale[..., None]
    return x.view(N, nb * FP8_BLOCK)[:, :D].to(dtype)


def store_rows(data: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor, values: torch.Tensor) -> None:
    """data[rows[i]] = values[i] as a cache stores rows: cast to data's dtype, or (``scale`` given, an FP8
    cache) quantised with ``quantize_fp8`` and its scales to ``scale[rows[i]]``. Rows that repeat (padding's
    null row) hold, element by element, one of their values (nothing reads them)."""
    rows = rows.reshape(-1)
    values = values.reshape(rows.shape[0], data.shape[-1])
    if scale is None:
        data.index_copy_(0, rows, values.to(data.dtype))
        return
    q, s = quantize_fp8(values)
    data.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))
    scale.index_copy_(0, rows, s)
