"""RoPE on the trailing rope channels (interleaved pairs) in one kernel: the plain-torch twin is
``dsv4.model.ops.apply_rope``'s body (a dozen small ops: float, four products, sub, add, stack, cat, to).
The kernel computes the angles itself from the rows' positions and the layer's frequency table (``angles``:
the float32 product, then cos and sin, which Triton takes from libdevice as torch's CUDA cos and sin are
CUDA's cosf and sinf), so a step's rope costs no launches of its own, and does the twin's fp32 arithmetic
without fused multiply-adds."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, enabled, pdl

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def angle_inputs(POS, FREQ, n, j, in_rope):
        """position[n] as float32 and table[j] (0 off the rope channels): ``angles``' loads, for a kernel that
        issues them with its other loads."""
        return tl.load(POS + n).to(tl.float32), tl.load(FREQ + j, mask=in_rope, other=0.0)

    @triton.jit
    def cos_sin(pos, freq, in_rope):
        """cos, sin of pos * freq (1 and 0 off the rope channels)."""
        a = pos * freq
        return tl.where(in_rope, tl.cos(a), 1.0), tl.where(in_rope, tl.sin(a), 0.0)

    @triton.jit
    def angles(POS, FREQ, n, j, in_rope):
        """cos, sin of position[n] * table[j] (1 and 0 off the rope channels)."""
        pos, freq = angle_inputs(POS, FREQ, n, j, in_rope)
        return cos_sin(pos, freq, in_rope)

    @triton.jit
    def rotate_pairs(x, cs, sn, BLOCK_H: tl.constexpr, RP: tl.constexpr):
        """x [BLOCK_H, 2*RP] (pairs (2i, 2i+1) of a row's rope channels, loaded contiguously) rotated by cs, sn
        [RP]: (a*cos - b*sin, a*sin + b*cos) per pair, as the twin's fp32 lines."""
        a, b = tl.split(tl.reshape(x, (BLOCK_H, RP, 2)))
        cs, sn = cs[None, :], sn[None, :]
        return tl.reshape(tl.join(a * cs - b * sn, a * sn + b * cs), (BLOCK_H, 2 * RP))

    @triton.jit
    def _rope_kernel(X, POS, FREQ, OUT, Hm, stride_xn, stride_xh, stride_on, stride_oh,
                     D: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, DNP: tl.constexpr,
                     BLOCK_H: tl.constexpr, INVERSE: tl.constexpr, COPY_NOPE: tl.constexpr, PDL: tl.constexpr):
        """Rows n, heads of a block: the R rope channels (the last of D) loaded contiguously, rotated, stored;
        the D - R others copied unless OUT is X (``COPY_NOPE`` False: rotated in place)."""
        enter(PDL)
        n = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = (h < Hm)[:, None]
        src = X + n * stride_xn + h[:, None] * stride_xh
        dst = OUT + n * stride_on + h[:, None] * stride_oh
        c = tl.arange(0, 2 * RP)
        mr = hm & (c < R)[None, :]
        x = tl.load(src + (D - R) + c[None, :], mask=mr, other=0.0).to(tl.float32)
        i = tl.arange(0, RP)
        cs, sn = angles(POS, FREQ, n, i, i < R // 2)
        if INVERSE:
            sn = -sn
        y = rotate_pairs(x, cs, sn, BLOCK_H, RP)
        tl.store(dst + (D - R) + c[None, :], y.to(OUT.dtype.element_ty), mask=mr)
        if COPY_NOPE:
            cn = tl.arange(0, DNP)
            mn = hm & (cn < D - R)[None, :]
            tl.store(dst + cn[None, :], tl.load(src + cn[None, :], mask=mn, other=0.0), mask=mn)


def usable(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> bool:
    """The kernel's case: CUDA (or Triton's interpreter), x [N, ..., D], positions [N] integers and a float32
    table [R/2] with an even nope width, so pairs are (even, odd) channels."""
    if not angles_fit(x, table, positions) or x.numel() == 0:
        return False  # (an empty x, e.g. a step that closes no compressor window, takes the torch lines)
    return (x.shape[-1] - 2 * table.shape[-1]) % 2 == 0


def angles_fit(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> bool:
    """What both rope kernels need of their angles' inputs: one integer position per row of x and a float32
    table no wider than half a row."""
    return (enabled() and x.dim() >= 2 and positions.dim() == 1 and x.shape[0] == positions.shape[0]
            and not positions.is_floating_point() and table.dim() == 1 and table.dtype == torch.float32
            and 2 * table.shape[0] <= x.shape[-1] and positions.device == x.device == table.device)


def rows_by_head(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, alloc_out: bool = True):
    """x [N, ..., D] as [N, Hm, D] with unit stride along D, the table and positions contiguous, and an empty
    output of that shape (None unless ``alloc_out``): the launch arguments of this kernel and of the fused norm +
    rope (``dsv4.kernels.norm``)."""
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    return (x3, table.contiguous(), positions.contiguous(),
            torch.empty(x3.shape, dtype=x.dtype, device=x.device) if alloc_out else None)


def apply_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
               in_place: bool = False) -> torch.Tensor:
    """x's rope channels rotated; ``in_place``: stored back into x's rope channels (the other channels are then
    neither read nor written), else into a new tensor."""
    N, D, R = x.shape[0], x.shape[-1], 2 * table.shape[-1]
    x3, table, positions, out = rows_by_head(x, table, positions, alloc_out=not in_place)
    out = x3 if in_place else out
    Hm = x3.shape[1]
    RP = max(1, triton.next_power_of_2(R // 2))
    DNP = triton.next_power_of_2(max(D - R, 1))
    width = 2 * RP if in_place else max(DNP, 2 * RP)  # the widest load a program makes per head
    BLOCK_H = max(1, min(triton.next_power_of_2(max(Hm, 1)), 4096 // width))
    if N and Hm:
        _rope_kernel[(N, triton.cdiv(Hm, BLOCK_H))](
            x3, positions, table, out, Hm, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
            D=D, R=R, RP=RP, DNP=DNP, BLOCK_H=BLOCK_H, INVERSE=inverse, COPY_NOPE=not in_place,
            enable_fp_fusion=False, **pdl.args())
    return out.view(x.shape)  # (in place: x itself, or its copy by rows where x was not laid out so)
