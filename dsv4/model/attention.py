"""DeepSeek-V4 attention: one shared K=V head with a sink, a sliding window on every layer, and on
compressed layers the entries of a KV compressor (all of them for HCA, the indexer's top-k for CSA).

The layers here own the weights and the per-token maths. Where keys come from is the business of an
``AttentionBackend`` passed to ``forward``: the dense reference backend (``dense.py``) builds every key
from the full sequence; the engine's cached backend reads and writes the KV cache through a step plan.
Both hand the layer the same things, so the maths is written once.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..config import ModelConfig, kind_spec
from ..kernels import project as project_kernel
from .ops import (Rope, apply_rope, index_scores, pool_windows, rms_norm, rms_norm_rope, sink_attention,
                  topk_mask)
from .fused import FusedLinears, project
from .rope import layer_inv_freq
from .rows import Linear, grouped_linear


class AttentionBackend(Protocol):
    """Where an attention layer's keys come from. N tokens are grouped as [G, Tq] for attention."""

    positions: torch.Tensor  # [N] absolute positions
    rope_memo: dict  # id(rope table) -> (table, Rope of ``positions``): filled by ``step_rope``

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [G, Tq, ...]"""

    def ungroup(self, x: torch.Tensor) -> torch.Tensor:
        """[G, Tq, ...] -> [N, ...]"""

    def kv_destination(self, layer_id: int) -> tuple | None:
        """(cache rows [R, D], this step's rows [N], FP8 scales [R, D/64] or None) where the kernel that makes
        this step's kv may store it, for a backend that reads the window from the cache after writing it; then
        ``window`` gets None for kv. None: the backend takes kv itself."""

    def window(self, layer_id: int, kv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's kv [N, D] (None: already stored at ``kv_destination``) -> sliding-window keys [G, K, D]
        and visibility [G, Tq, K]."""

    def write_window(self, layer_id: int, kv: torch.Tensor) -> None:
        """What ``window`` writes to the cache (this step's kv [N, D]), without reading the window back (a
        backend without a cache does nothing)."""

    def compressed(self, layer_id: int, name: str, comp: "Compressor",
                   rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's compressor rows ([N, 2*coff*D'] fp32: kv, then score; name "main" or "indexer") ->
        compressed entries [G, E, D'] and causal visibility [G, Tq, E] (entry w visible from position t
        iff w < (t+1) // ratio). Entries are made with ``comp.pool``."""

    def write_compressed(self, layer_id: int, name: str, comp: "Compressor", rows: torch.Tensor) -> None:
        """What ``compressed`` writes to the cache, without reading the entries back (a backend without a
        cache does nothing)."""

    def state_destination(self, layer_id: int, name: str, ratio: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(compressor-state ring, this step's rows [N]) where ``Compressor.project`` may store the step's rows,
        for a backend that pools windows after the ring is written; then ``compressed`` does not write them
        again. None: ``compressed`` writes them after pooling."""

    def select_top(self, compressed, q: torch.Tensor, w: torch.Tensor, keys, k: int):
        """The lightning indexer's top-k: ``compressed`` (what ``compressed(.., "main", ..)`` returned), the
        indexer's roped queries q [G, Tq, nI, dI], head weights w [G, Tq, nI] and ``keys`` (what
        ``compressed(.., "indexer", ..)`` returned) -> the same kind of pair with only the k highest-scoring
        visible entries of each query left visible (all of them when it sees at most k)."""

    def attend(self, q: torch.Tensor, window, compressed, sink: torch.Tensor, scale: float) -> torch.Tensor:
        """q [G, Tq, H, D] over the window keys and the selected compressed entries, one softmax with the
        sink -> [G, Tq, H, D]. ``window`` / ``compressed[0]`` are whatever ``window`` / ``compressed``
        returned (gathered tensors, or a kernel backend's handles on the cache). A backend whose
        ``takes_raw_q`` is True (absent: False) also takes ``q_norm`` = (eps, rope): q is then the raw
        projection, each head to be RMS-normed and roped (``ops.rms_norm_rope``) before it attends, and the
        output is returned rotated back by the same angles (``ops.apply_rope(.., inverse=True)``), which the
        caller otherwise does."""


def attend_gathered(q: torch.Tensor, window, compressed, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """``attend`` for backends whose keys are gathered tensors: concatenate, then ``sink_attention``."""
    keys, mask = window
    if compressed is not None:
        entries, visible = compressed
        keys = torch.cat((keys, entries.to(keys.dtype)), dim=1)
        mask = torch.cat((mask, visible), dim=-1)
    return sink_attention(q, keys, mask, sink, scale)


def select_top_gathered(compressed, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k: int):
    """``select_top`` for backends whose entries and index keys are gathered tensors: score every entry, keep a
    mask of the top k."""
    entries, visible = compressed
    scores = index_scores(q, w, keys, q.shape[-2], q.shape[-1])
    return entries, topk_mask(scores, visible, k)


def step_rope(backend: AttentionBackend, table: torch.Tensor) -> Rope:
    """The angles of the backend's positions for a rope table, one ``Rope`` per backend (one forward) and
    table, so the torch lines compute its cos/sin once; the memo keeps the table alive, so its id cannot be
    reused while the entry exists."""
    hit = backend.rope_memo.get(id(table))
    if hit is None:
        hit = backend.rope_memo[id(table)] = (table, Rope(table, backend.positions))
    return hit[1]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens into one entry. Ratio 4 overlaps (coff = 2): each token emits an
    A-half (feeds the next window) and a B-half (its own window), so an entry pools 8 token slots."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.coff = kind_spec(ratio).coff
        self.wkv = Linear(cfg.hidden_size, self.coff * head_dim, bias=False)
        self.wgate = Linear(cfg.hidden_size, self.coff * head_dim, bias=False)
        self.ape = nn.Parameter(torch.empty(ratio, self.coff * head_dim, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, cfg.norm_eps)
        self.inv_freq: torch.Tensor | None = None  # the layer's rope table, set by the attention layer

    def project(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                state: torch.Tensor | None = None, state_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``wkv(x)``, ``wgate(x)`` -> per-token rows [N, 2*coff*D] fp32: kv, then score = gate + ape[pos %
        ratio] (the layout of the compressor-state ring), also stored at ``state[state_rows]`` when given (a
        backend's ``state_destination``). On CUDA one kernel writes them (``dsv4.kernels.project``); the lines
        below are its twin."""
        if project_kernel.usable(kv):
            return project_kernel.project_rows(kv, gate, self.ape, positions, self.ratio, state, state_rows)
        score = gate.float() + self.ape.float()[positions % self.ratio]
        rows = torch.cat((kv.float(), score), dim=-1)
        if state is not None:
            state.index_copy_(0, state_rows, rows)
        return rows

    def pool(self, kv_rows: torch.Tensor, score_rows: torch.Tensor, valid: torch.Tensor,
             window_pos: torch.Tensor) -> torch.Tensor:
        """Make M entries from their windows' token rows.

        kv_rows, score_rows: [M, coff*ratio, coff*D] — for coff = 2 the first ``ratio`` rows are the
        previous window's tokens (their A-half [:D] is used), the last ``ratio`` rows the window's own
        tokens (their B-half [D:]); for coff = 1 just the window's tokens. valid: [M, coff*ratio] bool.
        window_pos: [M] the window start w*ratio, the entry's RoPE position. Returns [M, D] fp32.
        """
        D, r = self.head_dim, self.ratio
        if self.coff == 2:
            kv_rows = torch.cat((kv_rows[:, :r, :D], kv_rows[:, r:, D:]), dim=1)
            score_rows = torch.cat((score_rows[:, :r, :D], score_rows[:, r:, D:]), dim=1)
        return self.finish(pool_windows(kv_rows, score_rows, valid), window_pos)

    def finish(self, pooled: torch.Tensor, window_pos: torch.Tensor, out: torch.Tensor | None = None,
               out_rows: torch.Tensor | None = None, out_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """Pooled windows [M, D] -> entries: the compressor's RMSNorm, then RoPE at the window start; given a
        cache's rows ``out`` (and FP8 scales ``out_scale``) and ``out_rows`` [M], stored there instead
        (``ops.rms_norm_rope``)."""
        return rms_norm_rope(pooled, self.norm.weight, self.norm.eps, Rope(self.inv_freq, window_pos), out,
                             out_rows, out_scale)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: scores the compressed entries per query, keeps the top-k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg, 4, self.head_dim)

    def select(self, xs: dict, c_q: torch.Tensor, rope: Rope, compressed, backend: AttentionBackend,
               layer_id: int):
        """``xs``: the layer's input projections (``Attention.project_input``); ``compressed``: the layer's
        (entries, visibility [G, Tq, E]) from ``backend.compressed`` -> the same with only each query's top-k
        visible entries left (``backend.select_top``)."""
        rows = self.compressor.project(xs["idx_kv"], xs["idx_gate"], backend.positions,
                                       *(backend.state_destination(layer_id, "indexer", self.compressor.ratio) or ()))
        if compressed[1].shape[-1] <= self.topk:  # at most top-k entries exist: all visible ones are selected
            backend.write_compressed(layer_id, "indexer", self.compressor, rows)  # later steps need them
            return compressed
        keys, _ = backend.compressed(layer_id, "indexer", self.compressor, rows)  # [G, E, dI] or cache handles
        q = self.wq_b(c_q).unflatten(-1, (self.n_heads, self.head_dim))  # [N, nI, dI]
        q = apply_rope(q, rope, in_place=True)  # (wq_b's fresh output)
        w = xs["idx_w"]  # [N, nI]
        return backend.select_top(compressed, backend.group(q), backend.group(w), keys, self.topk)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, compress_ratio: int):
        super().__init__()
        self.cfg, self.layer_id, self.compress_ratio = cfg, layer_id, compress_ratio
        d, H, D, q = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
        self.wq_a = Linear(d, q, bias=False)
        self.q_norm = RMSNorm(q, cfg.norm_eps)
        self.wq_b = Linear(q, H * D, bias=False)
        self.wkv = Linear(d, D, bias=False)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        # grouped output projection: each group of H/g heads -> o_lora, then all groups -> d
        self.wo_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.compressor = Compressor(cfg, compress_ratio, D) if compress_ratio > 0 else None
        self.indexer = Indexer(cfg) if kind_spec(compress_ratio).has_indexer else None
        self.fused_input: FusedLinears | None = None
        self.init_tables()

    def input_linears(self) -> list[tuple[str, nn.Linear]]:
        """Every projection of the layer's input x (``project_input``'s names), in the fused weight's order."""
        named = [("q", self.wq_a), ("kv", self.wkv)]
        if self.compressor is not None:
            named += [("comp_kv", self.compressor.wkv), ("comp_gate", self.compressor.wgate)]
        if self.indexer is not None:
            c = self.indexer.compressor
            named += [("idx_kv", c.wkv), ("idx_gate", c.wgate), ("idx_w", self.indexer.weights_proj)]
        return named

    def fuse_input_projections(self) -> None:
        """One GEMM for up to seven projections of x (``dsv4.model.fused``); call once, after loading."""
        self.fused_input = FusedLinears(self.input_linears())

    def project_input(self, x: torch.Tensor) -> dict:
        return project(x, self.fused_input, self.input_linears)

    def init_tables(self, device=None, shared: dict | None = None):
        """(Re)compute the rope table on ``device`` (after loading weights built on the meta device). Layers
        given the same ``shared`` dict hold one tensor per distinct table, so ``step_rope`` computes each
        table's ``Rope`` once per step."""
        table = layer_inv_freq(self.cfg, self.compress_ratio).to(device)
        if shared is not None:
            table = shared.setdefault((tuple(table.shape), tuple(table.tolist())), table)
        self.inv_freq = table
        for comp in (self.compressor, self.indexer.compressor if self.indexer else None):
            if comp is not None:
                comp.inv_freq = self.inv_freq

    def write_window(self, x: torch.Tensor, backend: AttentionBackend) -> None:
        """Only this step's window rows, stored as ``forward`` stores them (the same projection and norm-rope, so
        the same bits): what later steps read of a layer whose output this step does not need (a paused MTP
        step's keep-up pass). A layer with a compressor has more state than the window: ``forward`` only."""
        if self.compressor is not None:
            raise ValueError(f"layer {self.layer_id} compresses (ratio {self.compress_ratio}): its compressor"
                             " state is written by forward, not by write_window")
        kv = self._stored_kv(self.project_input(x)["kv"], step_rope(backend, self.inv_freq), backend)
        if kv is not None:  # (written without reading the window: its keys are not wanted)
            backend.write_window(self.layer_id, kv)

    def _stored_kv(self, kv: torch.Tensor, rope, backend: AttentionBackend) -> torch.Tensor | None:
        """This step's kv [N, D] normed and roped (the K=V head); None when the norm-rope kernel stored it in the
        window ring itself (where the backend gives its destination)."""
        return rms_norm_rope(kv, self.kv_norm.weight, self.kv_norm.eps, rope,
                             *(backend.kv_destination(self.layer_id) or ()))

    def _window(self, kv: torch.Tensor, rope, backend: AttentionBackend):
        """This step's kv stored into the window ring; the window's keys for attention."""
        return backend.window(self.layer_id, self._stored_kv(kv, rope, backend))

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """x: [N, d] (attn-normed) -> [N, d]."""
        cfg, N = self.cfg, x.shape[0]
        # heads and output groups held by this module: all of them, or this rank's share under tensor
        # parallelism (dsv4.parallel splits wq_b / attn_sink / wo_a by whole groups and sums after wo_b)
        D = cfg.head_dim
        H = self.wq_b.weight.shape[0] // D
        g = self.wo_a.weight.shape[0] // cfg.o_lora_rank
        rope = step_rope(backend, self.inv_freq)  # the step's angles

        xs = self.project_input(x)
        c_q = self.q_norm(xs["q"])  # [N, q_lora], reused by the indexer
        q = self.wq_b(c_q).view(N, H, D)
        fuse = getattr(backend, "takes_raw_q", False)  # the attention (its kernel, or the backend) norms q
        if not fuse:
            q = rms_norm_rope(q, None, cfg.norm_eps, rope)  # per-head unweighted norm, then rope
        window = self._window(xs["kv"], rope, backend)
        compressed = None
        if self.compressor is not None:
            rows = self.compressor.project(xs["comp_kv"], xs["comp_gate"], backend.positions,
                                           *(backend.state_destination(self.layer_id, "main", self.compressor.ratio)
                                             or ()))
            compressed = backend.compressed(self.layer_id, "main", self.compressor, rows)
            if self.indexer is not None:
                compressed = self.indexer.select(xs, c_q, rope, compressed, backend, self.layer_id)

        if fuse:  # (the backend rotates the output back too)
            o = backend.ungroup(backend.attend(backend.group(q), window, compressed, self.attn_sink, D ** -0.5,
                                               q_norm=(cfg.norm_eps, rope)))
        else:
            o = backend.attend(backend.group(q), window, compressed, self.attn_sink, D ** -0.5)
            o = apply_rope(backend.ungroup(o), rope, inverse=True, in_place=True)  # the values carried rope too
        o = o.reshape(N, g, H * D // g)
        wo_a = self.wo_a.weight.view(g, cfg.o_lora_rank, H * D // g)
        o = grouped_linear(o, wo_a, self.wo_a.weight_scale)  # [N, g, o_lora]
        return self.wo_b(o.flatten(1))

