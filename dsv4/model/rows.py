"""Batch invariance: every row's matrix products computed the same way whatever else the step holds.

A GEMM library picks its kernel (tile shape, split-K) from the problem size, so the same row multiplied in a
batch of 8 rows and in a batch of 16 can round differently: in bf16 the greedy output with MTP on (verify
steps of 1 + k rows per request) then drifts from MTP off within a few tokens. Every other op of a decode or
verify step is already per row (norms, RoPE, mHC, the router, the grouped-GEMM MoE with fixed tiles, the
attention when its split does not follow the batch). Under ``fixed_rows(R)`` each projection runs on chunks of
exactly R rows (the last one padded with zeros), so its kernel, and with it every row's rounding, is the same
for any batch; the engine's ``batch_invariant`` setting enters it around every pass (and its scheduler runs a
prefill chunk alone, so a prompt's rows do not depend on what else is running, and decode rows only with each
other, on the decode kernels). Outside it (the default) a projection is one plain GEMM.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from ..kernels.bf16_gemv import grouped_linear as bf16_grouped_linear, linear as bf16_linear
from ..kernels.fp8_linear import BLOCK as FP8_BLOCK, dequantize, fp8_linear, grouped_fp8_linear

ROWS = 128  # rows per GEMM under batch invariance: a decode/verify step of 32 requests x (1 + 3 drafts) in one
_fixed: contextvars.ContextVar[int | None] = contextvars.ContextVar("dsv4_fixed_rows", default=None)


@contextlib.contextmanager
def fixed_rows(rows: int | None = ROWS):
    """Projections inside run on chunks of ``rows`` rows (None: no change)."""
    token = _fixed.set(rows)
    try:
        yield
    finally:
        _fixed.reset(token)


def active() -> bool:
    """Whether the code running now is under ``fixed_rows`` (the attention then keeps one path for any batch)."""
    return _fixed.get() is not None


def _chunked(x: torch.Tensor, rows: int, fn):
    """``fn`` over ``x``'s leading dim in chunks of exactly ``rows`` (zero-padded), results concatenated (each of
    them where ``fn`` returns a tuple)."""
    M = x.shape[0]
    pad = -M % rows
    if pad or M == 0:
        x = torch.cat([x, x.new_zeros(pad or rows, *x.shape[1:])])
    outs = [fn(c) for c in x.split(rows)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:M] for parts in zip(*outs))
    return torch.cat(outs)[:M]


def row_chunks(x: torch.Tensor, fn):
    """``fn(x)``; under ``fixed_rows``, ``fn`` over chunks of exactly that many rows (zero-padded), for row-wise
    torch code that is not a product: ATen's CPU elementwise loops run whole SIMD vectors and finish a tensor's
    last few elements with scalar code, whose exp or sigmoid can round differently (seen on an AVX2 machine), so
    a row's result would depend on where it sits in the batch. Chunks of ``ROWS`` rows have whole vectors only."""
    rows = _fixed.get()
    return fn(x) if rows is None else _chunked(x, rows, fn)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), per row the same for any number of rows under ``fixed_rows``.
    ``scale``: the weight is FP8 with these block scales (``dsv4.kernels.fp8_linear``); without, a product
    of one to four rows of a bf16 weight runs ``dsv4.kernels.bf16_gemv`` on CUDA."""
    fn = (lambda c: bf16_linear(c, weight)) if scale is None else (lambda c: fp8_linear(c, weight, scale))
    rows = _fixed.get()
    if rows is None:
        return fn(x)
    flat = x.reshape(-1, x.shape[-1])
    return _chunked(flat, rows, fn).reshape(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, g, i], weight [g, o, i] -> [N, g, o]: each group's rows times its own weight (``scale``: FP8 block
    scales over the weight as [g * o, i])."""
    if scale is None:  # a few rows take the bf16 row kernel on CUDA (each row's result independent of the others)
        fn = lambda c: bf16_grouped_linear(c, weight)  # noqa: E731
    else:
        fn = lambda c: grouped_fp8_linear(c, weight, scale)  # noqa: E731
    rows = _fixed.get()
    return fn(x) if rows is None else _chunked(x, rows, fn)


class Linear(nn.Linear):
    """``nn.Linear`` whose product follows ``fixed_rows`` (same parameters and state-dict names). After
    ``use_fp8`` its weight is an FP8 e4m3 buffer with a float32 ``scale`` per 128x128 block (state-dict names
    ``X.weight``, ``X.scale``), multiplied weight-only (``dsv4.kernels.fp8_linear``)."""

    fp8 = False

    def use_fp8(self) -> None:
        """Switch to the FP8 layout (on the meta device, before an FP8 state dict is adopted)."""
        if self.fp8:
            return
        out, inp = self.weight.shape
        device = self.weight.device
        del self._parameters["weight"]
        self.register_buffer("weight", torch.empty(out, inp, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("scale", torch.empty(-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK), device=device))
        self.fp8 = True

    @property
    def weight_scale(self) -> torch.Tensor | None:
        """The FP8 block scales, None for a plain weight."""
        return self.scale if self.fp8 else None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (dequantised when FP8)."""
        return dequantize(self.weight, self.scale, dtype) if self.fp8 else self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.weight_scale)
        return y if self.bias is None else y + self.bias
