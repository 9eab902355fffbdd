"""DeepSeek-V4 weight quantisation formats: decode at load, encode for test checkpoints.

Two formats are shipped (model doc section 9):

* FP8 e4m3 weights with one power-of-two scale per 128x128 block (attention, shared-expert and MTP
  linears). The scale is stored as e8m0 (a bare biased exponent byte: value = 2**(byte - 127)), or as
  float32 in older/third-party files (``weight_scale_inv``).
* FP4 e2m1 routed-expert weights, two per byte (the LOWER nibble holds the even element), with one
  e8m0 scale per 32 consecutive inputs of a row.

All decoding is done in float32 and cast to the requested dtype at the end, so it is exact: every
FP8/FP4 value times a power of two is representable in float32.
"""

from __future__ import annotations

import torch

from ..kernels.fp4 import E2M1_MAGNITUDES, e8m0_to_float, unpack_fp4

FP8_BLOCK = 128  # FP8 weights: one scale per FP8_BLOCK x FP8_BLOCK block
FP4_BLOCK = 32  # FP4 weights: one scale per FP4_BLOCK inputs of a row
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1


_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)  # torch >= 2.8
FP8_DTYPE = torch.float8_e4m3fn


def is_e8m0(t: torch.Tensor) -> bool:
    return _E8M0 is not None and t.dtype == _E8M0


def is_fp4_packed(t: torch.Tensor) -> bool:
    """True for the dtypes FP4 pairs are stored in: int8 (DeepSeek), uint8, float4_e2m1fn_x2."""
    return t.dtype in (torch.int8, torch.uint8) or (_FP4X2 is not None and t.dtype == _FP4X2)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a one-byte-per-element tensor as uint8 (no copy)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# e8m0 scales
# ------------------------------------------------------------------------------------------------
def _scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor stored as e8m0 (float8_e8m0fnu or uint8) or as a float dtype -> float32."""
    if is_e8m0(scale) or scale.dtype == torch.uint8:
        return e8m0_to_float(scale)
    return scale.to(torch.float32)


def _pow2_exponent(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive float32 x, computed exactly with frexp (x = m * 2**e, m in [0.5, 1))."""
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, e - 1, e)


def _float_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponents (int) -> e8m0 bytes, as float8_e8m0fnu where torch has it, else uint8."""
    b = (exponent + 127).clamp(0, 254).to(torch.uint8)
    return b.view(_E8M0) if _E8M0 is not None else b


# ------------------------------------------------------------------------------------------------
# FP8 e4m3, block 128x128
# ------------------------------------------------------------------------------------------------
def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    # scale [..., ceil(rows/br), ceil(cols/bc)] -> [..., rows, cols]
    s = scale.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    return s.repeat_interleave(block_cols, dim=-1)[..., :cols]


def dequant_fp8_block(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 e4m3 weight [..., out, in] with block scales [..., ceil(out/128), ceil(in/128)] -> dtype.

    The scale may be e8m0 (float8_e8m0fnu / uint8) or a float dtype (``weight_scale_inv`` files).
    """
    rows, cols = w_fp8.shape[-2:]
    want = (*w_fp8.shape[:-2], -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale has shape {list(scale.shape)}; weight {list(w_fp8.shape)} needs {list(want)}")
    s = _expand_blocks(_scale_to_float(scale), rows, cols, FP8_BLOCK, FP8_BLOCK)  # [..., out, in]
    return (w_fp8.to(torch.float32) * s).to(dtype)


def quant_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [out, in] to FP8 e4m3 with one power-of-two (e8m0) scale per 128x128 block.

    Returns (w_fp8 [out, in] float8_e4m3fn, scale [ceil(out/128), ceil(in/128)] e8m0). The scale is the
    smallest power of two with amax / scale <= 448, so no element saturates.
    """
    rows, cols = w.shape
    nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    w32 = w.detach().to(torch.float32)
    padded = w32.new_zeros(nr * FP8_BLOCK, nc * FP8_BLOCK)
    padded[:rows, :cols] = w32
    blocks = padded.view(nr, FP8_BLOCK, nc, FP8_BLOCK)  # [nr, 128, nc, 128]
    amax = blocks.abs().amax(dim=(1, 3))  # [nr, nc]
    exponent = torch.where(amax > 0, _pow2_exponent(amax / FP8_MAX), torch.zeros_like(amax, dtype=torch.int32))
    scale = _float_to_e8m0(exponent)
    s = _expand_blocks(e8m0_to_float(scale), rows, cols, FP8_BLOCK, FP8_BLOCK)  # [out, in]
    return (w32 / s).to(FP8_DTYPE), scale


# ------------------------------------------------------------------------------------------------
# FP4 e2m1, two per byte, scale per 32 inputs
# ------------------------------------------------------------------------------------------------
def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Packed e2m1 pairs [out, in/2] (int8 / uint8 / float4_e2m1fn_x2) with scales [out, in/32] -> [out, in].

    Nibble layout: LOWER nibble = even element, upper nibble = odd element; bit 3 of a nibble is the sign,
    bits 0-2 index the magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6). The scale may be e8m0 or a float dtype.
    """
    b = _as_bytes(packed)
    rows, half = b.shape
    cols = 2 * half
    want = (rows, -(-cols // FP4_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP4 scale has shape {list(scale.shape)}; packed weight {list(b.shape)} needs {list(want)}")
    return unpack_fp4(b, scale, dtype)


def _nearest_e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale (|x| <= 6) -> 4-bit codes (round to nearest magnitude)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)  # ties go to the smaller magnitude
    sign = ((x < 0) & (idx > 0)).long() << 3  # no negative zero
    return idx | sign


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [out, in] (in even) to packed FP4 e2m1 with one e8m0 scale per 32 inputs.

    Returns (packed [out, in/2] int8 as DeepSeek ships it, scale [out, ceil(in/32)] e8m0). The scale is the
    smallest power of two with amax / scale <= 6.
    """
    rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"FP4 packing needs an even number of inputs, got {cols}")
    nb = -(-cols // FP4_BLOCK)
    w32 = w.detach().to(torch.float32)
    padded = w32.new_zeros(rows, nb * FP4_BLOCK)
    padded[:, :cols] = w32
    amax = padded.view(rows, nb, FP4_BLOCK).abs().amax(dim=-1)  # [out, nb]
    exponent = torch.where(amax > 0, _pow2_exponent(amax / FP4_MAX), torch.zeros_like(amax, dtype=torch.int32))
    scale = _float_to_e8m0(exponent)
    s = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, dim=-1)[:, :cols]  # [out, in]
    codes = _nearest_e2m1_code(w32 / s).view(rows, cols // 2, 2)  # [out, in/2, (even, odd)]
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scale


# ------------------------------------------------------------------------------------------------
# Stacked routed experts kept packed on the device (the engine's ``fp4`` expert format)
# ------------------------------------------------------------------------------------------------
def pack_fp4_stacked(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, out, in] (in a multiple of 32) -> (packed [E, out, in/2] uint8, e8m0 scale
    bytes [E, out, in/32] uint8): ``quant_fp4`` per row, as plain bytes for the kernels. Lossless for weights
    that were FP4 to begin with (a checkpoint's experts, dequantised at read): the same values come back."""
    E, rows, cols = w.shape
    if cols % FP4_BLOCK:
        raise ValueError(f"FP4 experts need an input width that is a multiple of {FP4_BLOCK}, got {cols}")
    packed = torch.empty(E, rows, cols // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(E, rows, cols // FP4_BLOCK, dtype=torch.uint8, device=w.device)
    for e in range(E):  # one expert at a time: the encode's temporaries are several times the weight's size
        p, s = quant_fp4(w[e])
        packed[e], scale[e] = p.view(torch.uint8), _as_bytes(s)
    return packed, scale
