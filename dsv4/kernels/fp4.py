"""FP4 e2m1 weights with e8m0 scales, decoded in plain torch: the twin of the kernels' in-loop decode
(``fp4_gemv.e2m1_word`` and the scale per 32 inputs, in ``moe`` and ``fp4_gemv``) and the decoder of the checkpoint format
(``dsv4.checkpoint.quant.dequant_fp4``).

Two codes per byte, the LOWER nibble the even input; bit 3 of a nibble is the sign, bits 0-2 index the
magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6). One scale byte per 32 inputs of a row: 2**(byte - 127)."""

from __future__ import annotations

import torch

BLOCK = 32  # inputs per scale
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 exponent bytes (uint8 or float8_e8m0fnu) to float32: 2**(byte - 127); byte 255 is NaN.

    Built from the float32 bit pattern, so it is exact down to 2**-127 (a float32 subnormal).
    """
    b = (t if t.dtype == torch.uint8 else t.view(torch.uint8)).to(torch.int32)
    bits = b << 23  # exponent field of a float32 with zero mantissa: 2**(b - 127) for b in 1..254
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)  # 2**-127: subnormal
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)


def e2m1_table(device) -> torch.Tensor:
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # [16]: index = nibble


def unpack_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed codes [..., out, in/2] (uint8) with scales [..., out, ceil(in/32)] (e8m0 bytes as uint8 or
    float8_e8m0fnu, or float values) -> [..., out, in] in ``dtype``, exact (decoded in float32)."""
    lo, hi = (packed & 0x0F).long(), (packed >> 4).long()
    nibbles = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., out, in]: even, odd, even, ...
    values = e2m1_table(packed.device)[nibbles]
    is_bytes = scale.dtype == torch.uint8 or (_E8M0 is not None and scale.dtype == _E8M0)
    s = (e8m0_to_float(scale) if is_bytes else scale.to(torch.float32)).repeat_interleave(BLOCK, dim=-1)
    return (values * s[..., : values.shape[-1]]).to(dtype)
