"""The DeepSeek-V4 causal LM: embedding -> blocks on mHC streams -> hc_head -> norm -> head, plus the MTP module.

``model(input_ids)`` is the dense reference forward (no cache). The engine drives the same blocks through
``streams`` / ``logits_from_streams`` / ``mtp_streams`` with its cached backend. Each names its rows to the kernels'
launches (``kernels.pdl.pass_rows``: passes of at most 4 rows release early).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.pdl import pass_rows
from .attention import AttentionBackend, RMSNorm
from .block import Block, MTPBlock
from .dense import DenseBackend
from .expert_weights import StackedExperts
from .mhc import hc_head
from .rows import Linear


class MTPUnavailableError(RuntimeError):
    """MTP was asked of a model whose checkpoint has no MTP weights."""


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool | None = None):
        super().__init__()
        self.cfg = cfg
        d, n = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(cfg, i, r, cfg.is_hash_layer(i)) for i, r in enumerate(cfg.compress_ratios))
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.head = Linear(d, cfg.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        with_mtp = cfg.has_mtp if with_mtp is None else with_mtp
        self.mtp = nn.ModuleList([MTPBlock(cfg, cfg.num_layers)] if with_mtp else [])

    @property
    def has_mtp(self) -> bool:
        return len(self.mtp) > 0

    def init_tables(self, device=None):
        """Rope tables on ``device`` (they are not checkpoint tensors)."""
        shared = {}
        for blk in list(self.layers) + list(self.mtp):
            blk.attn.init_tables(device, shared)

    def finish_loading(self, device) -> "DeepseekV4":
        """After the checkpoint tensors are adopted on ``device``: rope tables, fused projections on CUDA (fewer,
        larger GEMMs where launches and small reads cost), packed experts' scale range (``note_scales``),
        inference mode."""
        device = torch.device(device)
        self.init_tables(device)
        if device.type == "cuda":
            self.fuse_projections()
        for m in self.modules():
            if isinstance(m, StackedExperts):
                m.note_scales()
        return self.eval().requires_grad_(False)

    def fuse_projections(self) -> None:
        """Projections that share an input become one GEMM each (``dsv4.model.fused``): a layer's input
        projections, a shared expert's w1 and w3. For the GPU, after loading (weights become views)."""
        for blk in list(self.layers) + list(self.mtp):
            blk.attn.fuse_input_projections()
            if blk.ffn.shared_experts is not None:
                blk.ffn.shared_experts.fuse()

    # ---- pieces the engine drives -----------------------------------------------------------------
    def streams(self, input_ids: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """input_ids: [N] -> the last layer's hc streams [N, n, d] (before hc_head)."""
        with pass_rows(input_ids.shape[0]):
            # each stream's copy of the token's row gathered from the table: one gather writing [N, n, d], not a
            # gather and then a copy from a broadcast view (on the GPU a strided, unvectorised copy kernel)
            X = self.embed(input_ids.unsqueeze(1).expand(-1, self.cfg.hc_mult))
            mix = None  # each block's write-back computes the next block's first mixing partials
            for i, blk in enumerate(self.layers):
                nxt = self.layers[i + 1].hc_attn_fn if i + 1 < len(self.layers) else None
                X, mix = blk(X, backend, input_ids, mix, nxt)
        return X

    def logits_from_streams(self, X: torch.Tensor) -> torch.Tensor:
        """[N, n, d] -> logits [N, V] fp32."""
        c = self.cfg
        with pass_rows(X.shape[0]):
            u = hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.norm_eps,
                        self.norm.weight)  # normed by self.norm
            return self.head(u).float()

    def mtp_streams(self, X: torch.Tensor, next_ids: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """One MTP pass: streams at t [N, n, d] + token t+1 [N] -> MTP streams [N, n, d]."""
        if not self.has_mtp:
            raise MTPUnavailableError("this checkpoint has no MTP weights (no mtp.* tensors); run without"
                                      " speculative decoding or use a checkpoint that ships the MTP layer")
        with pass_rows(X.shape[0]):
            return self.mtp[0](X, self.embed(next_ids), backend, next_ids)

    @property
    def mtp_window_only(self) -> bool:
        """Whether the model has an MTP layer whose only state is its window ring (``keep_up`` holds it all)."""
        return self.has_mtp and self.mtp[0].keeps_up

    def mtp_keep_up(self, X: torch.Tensor, next_ids: torch.Tensor, backend: AttentionBackend) -> None:
        """An MTP pass whose output nobody reads (drafting paused): only the MTP layer's window rows, as
        ``mtp_streams`` stores them; the whole pass where the layer holds more state than its window."""
        if not self.mtp_window_only:
            self.mtp_streams(X, next_ids, backend)
            return
        with pass_rows(X.shape[0]):
            self.mtp[0].keep_up(X, self.embed(next_ids), backend)

    def mtp_logits_from_streams(self, X_mtp: torch.Tensor) -> torch.Tensor:
        with pass_rows(X_mtp.shape[0]):
            return self.head(self.mtp[0].head_input(X_mtp)).float()

    # ---- the dense reference path -------------------------------------------------------------------
    def _dense_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        backend = DenseBackend(B, T, self.cfg.window_size, input_ids.device)
        return self.streams(input_ids.reshape(-1), backend)  # [B*T, n, d]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Dense full-sequence forward from position 0: [B, T] -> logits [B, T, V]."""
        B, T = input_ids.shape
        return self.logits_from_streams(self._dense_streams(input_ids)).view(B, T, -1)

    @torch.no_grad()
    def mtp_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T-1, V]: row t from the main streams at t and token t+1, predicting token t+2.
        One full-sequence pass of the MTP layer over positions 0..T-2 (its window sees earlier rows)."""
        B, T = input_ids.shape
        if T < 2:
            raise ValueError("mtp_logits needs at least 2 tokens per sequence")
        X = self._dense_streams(input_ids).view(B, T, *self._stream_shape())[:, :-1]  # streams at 0..T-2
        next_ids = input_ids[:, 1:].reshape(-1)
        backend = DenseBackend(B, T - 1, self.cfg.window_size, input_ids.device)
        X_mtp = self.mtp_streams(X.reshape(-1, *self._stream_shape()), next_ids, backend)
        return self.mtp_logits_from_streams(X_mtp).view(B, T - 1, -1)

    def _stream_shape(self) -> tuple[int, int]:
        return self.cfg.hc_mult, self.cfg.hidden_size
