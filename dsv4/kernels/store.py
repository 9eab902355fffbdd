"""A step's rows stored into a cache tensor where the plan sends them, the rows it sends to the null row left out.

A prefill chunk's plan sends every row of a request but the ring's last window to the null slot's row 0
(``cache.plan``'s ``ring_write``), which nothing reads. ``index_copy_`` (``kernels.fp8.store_rows``, the twin) writes
all of them, an 8k-token chunk's 8k rows into that one row: the thirty-ninth session's 8k profile (H100) shows
four ``index_copy`` launches of 77 us a layer. Here a program a row returns at once for those. Rows sent anywhere
else get the same values as the twin gives them (cast to the cache's dtype)."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def _store_kept_kernel(ROWS, SRC, DST, stride_s, stride_d, D, NULL, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        n = tl.program_id(0)
        r = tl.load(ROWS + n)
        if r != NULL:
            c = tl.arange(0, BLOCK)
            for d0 in range(0, D, BLOCK):
                m = d0 + c < D
                x = tl.load(SRC + n.to(tl.int64) * stride_s + d0 + c, mask=m)
                tl.store(DST + r.to(tl.int64) * stride_d + d0 + c, x.to(DST.dtype.element_ty), mask=m)


def usable(data: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> bool:
    """The kernel's case: on the kernels' device, a float cache [R, D] and values [N, D] with unit stride along D,
    rows [N] integers."""
    return (on(data, rows, values) and data.dim() == 2 and values.dim() == 2 and rows.dim() == 1
            and values.shape == (rows.shape[0], data.shape[1]) and data.stride(1) == 1 and values.stride(1) == 1
            and data.dtype in (torch.float32, torch.bfloat16, torch.float16) and values.is_floating_point()
            and not rows.is_floating_point())


def store_kept_rows(data: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, null: int = 0) -> None:
    """data[rows[i]] = values[i] (cast to data's dtype) for every i with rows[i] != ``null``; rows sent to ``null``
    are not written (``usable`` must hold)."""
    N, D = values.shape
    if N:
        BLOCK = min(triton.next_power_of_2(D), 1024)
        _store_kept_kernel[(N,)](rows.contiguous(), values, data, values.stride(0), data.stride(0), D, null,
                                 BLOCK=BLOCK, num_warps=4, **pdl.args())
