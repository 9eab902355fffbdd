"""A transformer block (attention then MoE, each wrapped in mHC) and the MTP block built on it."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention, AttentionBackend, RMSNorm
from .mhc import Mix, hc_discard, hc_head, hc_post_mix, hc_pre
from .moe import MoE
from .rows import Linear


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, compress_ratio: int, is_hash: bool):
        super().__init__()
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.hidden_size
        mix = (2 + n) * n
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.norm_eps)
        self.attn = Attention(cfg, layer_id, compress_ratio)
        self.ffn = MoE(cfg, is_hash)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, n * d, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.empty(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))

    def _hc_pre(self, X: torch.Tensor, site: str, mix: Mix | None = None):
        """The streams collapsed for the sub-block and normed by its norm (one kernel on the GPU; the mix's RMS
        and the norm share the config's norm_eps)."""
        c = self.cfg
        return hc_pre(X, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                      getattr(self, f"hc_{site}_scale"), c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps,
                      getattr(self, f"{site}_norm").weight, mix)

    def forward(self, X: torch.Tensor, backend: AttentionBackend, token_ids: torch.Tensor, mix: Mix | None = None,
                next_fn: torch.Tensor | None = None) -> tuple[torch.Tensor, Mix | None]:
        """X: [N, n, d] streams; token_ids: [N] (for hash routing) -> ([N, n, d], its mixing partials for the
        collapse with rows ``next_fn`` (the next block's attention's) where the write-back computes them, else
        None: ``hc_post_mix``). ``mix``: X's for this block's attention, from the block before."""
        u, post, comb = self._hc_pre(X, "attn", mix)
        X, mix = hc_post_mix(self.attn(u, backend), X, post, comb, self.hc_ffn_fn)
        u, post, comb = self._hc_pre(X, "ffn", mix)
        return hc_post_mix(self.ffn(u, token_ids), X, post, comb, next_fn)


class MTPBlock(Block):
    """The MTP module: predicts token t+2 from the main model's last-layer streams at t (before hc_head)
    and the embedding of token t+1. A full block (sliding-window attention only, scored MoE) with its own
    hc_head and norm; the embedding and the lm head are the main model's."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id, compress_ratio=0, is_hash=False)
        d, n = cfg.hidden_size, cfg.hc_mult
        self.e_proj = Linear(d, d, bias=False)
        self.h_proj = Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.norm_eps)
        self.hnorm = RMSNorm(d, cfg.norm_eps)
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, X: torch.Tensor, next_embed: torch.Tensor, backend: AttentionBackend,
                next_ids: torch.Tensor) -> torch.Tensor:
        """X: [N, n, d] streams at t; next_embed: [N, d] = Emb(token t+1) -> the MTP streams [N, n, d]."""
        return super().forward(self._input(X, next_embed), backend, next_ids)[0]

    def _input(self, X: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        e = self.e_proj(self.enorm(next_embed))  # [N, d], broadcast to every stream
        return self.h_proj(self.hnorm(X)) + e.unsqueeze(1)  # hnorm normalises each stream

    @property
    def keeps_up(self) -> bool:
        """Whether ``keep_up`` holds all the state a later pass reads (a window-only attention, as DeepSeek-V4's)."""
        return self.attn.compressor is None

    def keep_up(self, X: torch.Tensor, next_embed: torch.Tensor, backend: AttentionBackend) -> None:
        """The part of ``forward`` later passes read: this step's window rows of the MTP layer's attention, the
        same bits ``forward`` stores (its attention output, the MoE and the write-backs are not computed)."""
        X = self._input(X, next_embed)
        u, _, _ = self._hc_pre(X, "attn")
        hc_discard(X)
        self.attn.write_window(u, backend)

    def head_input(self, X: torch.Tensor) -> torch.Tensor:
        """MTP streams -> the normed vector the shared lm head reads: [N, d]."""
        c = self.cfg
        return hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.norm_eps,
                       self.norm.weight)  # normed by self.norm
