"""Projections that read the same input, run as one GEMM.

At decode sizes a projection of a few MB costs about as much as launching it and filling the GPU (cuBLAS
reads a 1024x4096 weight at about a quarter of the copy bandwidth, BENCHMARKS.md), so the projections of one
input are better done as one GEMM over their concatenated weights. ``FusedLinears`` concatenates the weights
once, after loading, and points every module's weight at its rows of the result, so memory is not doubled
and the modules (and their state-dict names) stay as they are. The unfused modules, called one by one, are
its twin; the model fuses on CUDA only.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..kernels.fp8_linear import BLOCK as FP8_BLOCK
from .rows import Linear, linear


class FusedLinears:
    """Bias-free linears of one input: ``fused(x)`` -> {name: module(x)} in one GEMM per weight format (FP8
    linears with block scales in one, plain ones in another; an FP8 linear whose rows end inside a 128-row
    scale block, other than the last, keeps its own GEMM)."""

    def __init__(self, named: list[tuple[str, nn.Linear]]):
        for name, m in named:  # one F.linear replaces their forwards: only plain bias-free linears qualify
            if type(m) not in (nn.Linear, Linear) or m.bias is not None:
                raise TypeError(f"FusedLinears: {name!r} is a {type(m).__name__} (bias: {m.bias is not None});"
                                " only plain bias-free nn.Linear modules can share one GEMM")
        plain = [(n, m) for n, m in named if not getattr(m, "fp8", False)]
        fp8 = [(n, m) for n, m in named if getattr(m, "fp8", False)]
        self.groups = [_Group(plain)] if plain else []
        if all(m.weight.shape[0] % FP8_BLOCK == 0 for _, m in fp8[:-1]):
            self.groups += [_Group(fp8)] if fp8 else []
        else:
            self.groups += [_Group([nm]) for nm in fp8]
        self.names = [name for g in self.groups for name in g.names]

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.groups:
            out.update(zip(g.names, linear(x, g.weight, g.scale).split(g.sizes, dim=-1)))
        return out


class _Group:
    """Linears of one format whose weights (and FP8 scales) are concatenated into one; every module's weight
    becomes a view of its rows."""

    def __init__(self, named: list[tuple[str, nn.Linear]]):
        self.names = [name for name, _ in named]
        self.sizes = [m.weight.shape[0] for _, m in named]
        fp8 = getattr(named[0][1], "fp8", False)
        self.weight = torch.cat([m.weight.detach() for _, m in named])
        self.scale = torch.cat([m.scale for _, m in named]) if fp8 else None
        off = 0
        for (_, m), n in zip(named, self.sizes):
            if fp8:  # buffers: plain tensors
                m.weight, m.scale = self.weight[off:off + n], self.scale[off // FP8_BLOCK:-(-(off + n) // FP8_BLOCK)]
            else:
                m.weight = nn.Parameter(self.weight[off:off + n], requires_grad=False)
            off += n


def project(x: torch.Tensor, fused: FusedLinears | None, named: Callable[[], list[tuple[str, nn.Linear]]]) -> dict:
    """{name: module(x)}: one GEMM when ``fused``, else module by module (``named`` lists them; it is called only
    then, so a fused forward builds no list)."""
    return fused(x) if fused is not None else {name: m(x) for name, m in named()}
