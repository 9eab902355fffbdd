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

from .rows import Linear, linear


class FusedLinears:
    """Bias-free linears of one input: ``fused(x)`` -> {name: module(x)} in one GEMM."""

    def __init__(self, named: list[tuple[str, nn.Linear]]):
        for name, m in named:  # one F.linear replaces their forwards: only plain bias-free linears qualify
            if type(m) not in (nn.Linear, Linear) or m.bias is not None:
                raise TypeError(f"FusedLinears: {name!r} is a {type(m).__name__} (bias: {m.bias is not None});"
                                " only plain bias-free nn.Linear modules can share one GEMM")
        self.names = [name for name, _ in named]
        self.sizes = [m.weight.shape[0] for _, m in named]
        self.weight = torch.cat([m.weight.detach() for _, m in named])
        off = 0
        for (_, m), n in zip(named, self.sizes):
            m.weight = nn.Parameter(self.weight[off:off + n], requires_grad=False)
            off += n

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, linear(x, self.weight).split(self.sizes, dim=-1)))


def project(x: torch.Tensor, fused: FusedLinears | None, named: Callable[[], list[tuple[str, nn.Linear]]]) -> dict:
    """{name: module(x)}: one GEMM when ``fused``, else module by module (``named`` lists them; it is called only
    then, so a fused forward builds no list)."""
    return fused(x) if fused is not None else {name: m(x) for name, m in named()}
