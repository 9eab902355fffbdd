"""Mixture of experts: sqrt-softplus scores, a selection-only bias, hash routing on the first layers,
routed SwiGLU experts with the swiglu clamp, and one shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..config import ModelConfig
from ..kernels.side_stream import fork, join, side_stream
from .expert_weights import StackedExperts
from .fused import FusedLinears, project
from .ops import add_to, swiglu_to
from .rows import Linear, linear
from .rows import active as rows_active


# With SHARED_OVERLAP the shared expert runs on a second stream of its device while a CUDA graph is captured
# (decode, verify and prefill-chunk graphs): its three launches (FP8 or bf16 w1+w3, SwiGLU, w2) overlap the
# router's, the expert alignment's and the routed experts' launches, most of them too small to fill the GPU at
# decode sizes, and join the main stream just before the combine that adds them. Same kernels and inputs, so the
# same bits.
# Measured on an H100 (flash-L20-E128, FP4 experts, FP8 linears; decode_floor.py --no-shared-overlap is the A/B):
# overlapped step 4.57 against 4.81 ms at batch 1, 10.75 against 11.16 at batch 8 (BENCHMARKS.md, 24th session).
SHARED_OVERLAP = True


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool):
        super().__init__()
        self.cfg, self.is_hash = cfg, is_hash
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:  # token id -> its fixed experts
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.n_experts_per_tok, dtype=torch.long))
        else:  # shifts the selection only, never the weights
            self.bias = nn.Parameter(torch.empty(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, d] -> (weights [N, k] fp32, expert ids [N, k])."""
        if kernels.on(x):  # two kernels on the GPU (dsv4.kernels.gate); the lines below are their twin
            from ..kernels.gate import route

            return route(x, self.weight, None if self.is_hash else self.bias, self.tid2eid if self.is_hash else None,
                         token_ids, self.cfg.n_experts_per_tok, self.cfg.score_func, self.cfg.route_scale,
                         invariant=rows_active())
        logits = linear(x.float(), self.weight.float())
        if self.cfg.score_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.cfg.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.is_hash:
            ids = self.tid2eid[token_ids]
        else:
            ids = (scores + self.bias.float()).topk(self.cfg.n_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.cfg.score_func != "softmax":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.cfg.route_scale, ids


class Experts(StackedExperts):
    """Routed experts, stacked: w1/w3 [E, I, d], w2 [E, d, I] (or packed FP4: ``expert_weights``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.grouped_kernel = kernels.enabled()
        self._make_weights(cfg.n_routed_experts, cfg.moe_inter_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, add=None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tokens grouped per expert. x: [N, d]; weights, ids: [N, k]. Returns the fp32 sum over each token's
        experts plus ``add`` [N, d] (the shared expert's output, or a function giving it, called right before
        the addition: ``MoE.forward``'s join of the side stream), rounded once to ``out_dtype``: [N, d].

        On CUDA the grouping happens on the device (a Triton grouped GEMM, no host sync, graph-safe);
        this host-side loop is its plain-torch twin."""
        if x.is_cuda and self.grouped_kernel:
            from ..kernels.moe import grouped_experts  # lazy: kernels import model.ops

            return grouped_experts(x, weights, ids, self.w1, self.w2, self.w3, self.limit, scales=self.scales(),
                                   invariant=rows_active(), add=add, out_dtype=out_dtype, fold=self.fold)
        N, k = ids.shape
        flat = ids.flatten()  # [N*k] one row per (token, choice)
        order = flat.argsort(stable=True)  # rows grouped by expert
        counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()
        xs = x[order // k]  # [N*k, d] the token of each grouped row
        ws = weights.flatten()[order].unsqueeze(-1)
        out = torch.empty(N * k, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c:
                seg = slice(start, start + c)
                # routing weight before w2, as DeepSeek does
                w1, w2, w3 = self.expert_weights(e, x.dtype)
                # (``linear``: in fixed row chunks under batch invariance, so an expert's rows do not round
                # with how many rows it got)
                h = swiglu_to(linear(xs[seg], w1), linear(xs[seg], w3), self.limit, ws[seg, 0], x.dtype)
                out[seg] = linear(h, w2).float()
                start += c
        y = torch.empty_like(out)
        y[order] = out
        return add_to(y.view(N, k, -1).sum(dim=1), add() if callable(add) else add, out_dtype)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, I = cfg.hidden_size, cfg.moe_inter_dim
        self.limit = cfg.swiglu_limit if cfg.shared_expert_clamp else 0.0
        self.w1 = Linear(d, I, bias=False)
        self.w2 = Linear(I, d, bias=False)
        self.w3 = Linear(d, I, bias=False)
        self.fused: FusedLinears | None = None

    def input_linears(self) -> list[tuple[str, nn.Linear]]:
        return [("gate", self.w1), ("up", self.w3)]

    def fuse(self) -> None:
        """w1 and w3 read the same x: one GEMM (``dsv4.model.fused``); call once, after loading."""
        self.fused = FusedLinears(self.input_linears())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, d] in x's dtype (MoE adds it to the fp32 routed sum: the promotion is exact)."""
        h = project(x, self.fused, self.input_linears)
        return self.w2(swiglu_to(h["gate"], h["up"], self.limit, None, x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool):
        super().__init__()
        self.gate = Gate(cfg, is_hash)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x: [N, d], token_ids: [N] (hash routing) -> [N, d]."""
        side = (side_stream(x, SHARED_OVERLAP) if self.shared_experts is not None and isinstance(self.experts, Experts)
                else None)
        if side is None:
            weights, ids = self.gate(x, token_ids)
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            return self.experts(x, weights, ids, add=shared, out_dtype=x.dtype)  # routed + shared, rounded once
        with fork(side, x.device):  # after x is ready
            shared = self.shared_experts(x)
        weights, ids = self.gate(x, token_ids)

        def joined() -> torch.Tensor:  # the combine's input: the main stream waits for the side stream here
            join(side, x.device)
            return shared

        return self.experts(x, weights, ids, add=joined, out_dtype=x.dtype)
