"""Fetch a weight into the L2 cache ahead of the kernel that reads it (Hopper's bulk prefetch; an experiment).

A decode step at one request is weight GEMVs separated by chains of small latency-bound kernels, during which the
DRAM idles; an H100's L2 holds 50 MB, more than any one of Flash's projections. ``prefetch_l2(w)`` asks the copy
engine to bring ``w``'s bytes into L2 (``cp.async.bulk.prefetch.L2.global``, CHUNK bytes a request, no registers,
nothing written), so a GEMV launched after the chain may read them from L2. It changes no value: a prefetch only
moves bytes between DRAM and the cache. Launched on a side stream during a graph capture
(``model.attention.L2_PREFETCH``), it runs beside the chain. On devices before Hopper, without Triton or off CUDA
it does nothing. Whether it pays is measured by bench/l2_prefetch_gpu.py and decode_floor.py --l2-prefetch."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on

CHUNK = 16384  # bytes a bulk prefetch request
PER = 8  # requests a program
ALIGN = 16  # the instruction's address and size granularity

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _bulk_prefetch(BASE, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr):
        """Program p asks for PER chunks of CHUNK bytes from BASE + p * PER * CHUNK (an address, 16-byte aligned)
        into L2, the last one cut to what is left of nbytes (a multiple of 16)."""
        offs = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [BASE + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def _supported(t: torch.Tensor) -> bool:
    return on(t) and torch.cuda.get_device_capability(t.device)[0] >= 9


def span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the 16-byte-aligned run inside ``t``'s storage span (contiguous t)."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // ALIGN) * ALIGN
    hi = end // ALIGN * ALIGN
    return lo, max(0, hi - lo)


def prefetch_l2(t: torch.Tensor) -> None:
    """Ask for contiguous ``t``'s bytes in L2 (nothing where unsupported; see the module's text)."""
    if not (t.is_contiguous() and _supported(t)):
        return
    base, nbytes = span(t)
    if nbytes:
        _bulk_prefetch[(triton.cdiv(nbytes, CHUNK * PER),)](base, nbytes, CHUNK=CHUNK, PER=PER, num_warps=1)
