"""One rank's part of the model: slice the state dict, build the model with the split modules.

What is split (see ``mapping.py``): attention heads by whole output groups (``wq_b`` rows, ``attn_sink``,
``wo_a`` rows, ``wo_b`` input columns, then a sum over ranks), and the routed experts (``E / ep`` experts
per expert-parallel rank, their intermediate dimension split ``moe_tp`` ways). Everything else is
replicated: the shared K=V head, ``wq_a`` / ``q_norm``, the compressors and the indexer, the gate, the
shared expert, embedding, head, norms, mHC, and the MTP module's projections. The MTP block is split like
the target blocks. The model code is unchanged: ``Attention`` reads its head count from ``wq_b``; the
split modules below replace ``wo_b`` and ``experts`` and carry the collectives.

FP8 linears (``linear_format: fp8``) are split with their block scales: a share of rows (or of ``wo_b``'s
columns) takes the scale blocks it lies in, which is exact when the share starts on a 128 boundary or lies
inside one block (``fp8_share``); other shares are refused before any rank starts (``check_fp8_shards``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .. import kernels
from ..config import ModelConfig
from ..kernels.fp8_linear import BLOCK as FP8_BLOCK
from ..model.expert_weights import StackedExperts, adopt_layout, check_fp4_shapes, is_packed
from ..model.linear_weights import adopt_linear_layout
from ..model.model import DeepseekV4
from ..model.ops import add_to, swiglu_to
from ..model.rows import Linear
from ..model.rows import active as rows_active
from .comm import Collectives
from .mapping import ParallelMapping

_BLOCK = r"^(layers\.\d+|mtp\.0)\."
# wq_b [H*D, q]: head h is rows h*D .. h*D+D-1; wo_a [g*o, H*D/g]: group i is rows i*o .. i*o+o-1 (the heads
# of group i); wo_b [d, g*o]: input columns follow the groups. FP8 linears: their scales' blocks too
_ATTN_SPLIT = re.compile(_BLOCK + r"attn\.(wq_b|wo_a|wo_b)\.(weight|scale)$")
_SINK = re.compile(_BLOCK + r"attn\.attn_sink$")
_W13 = re.compile(_BLOCK + r"ffn\.experts\.w[13](_scale)?$")  # their rows: I
_W2 = re.compile(_BLOCK + r"ffn\.experts\.w2(_scale)?$")  # their columns: I (bytes or scale blocks when packed)


def _share(n: int, parts: int, index: int) -> slice:
    size = n // parts
    return slice(index * size, (index + 1) * size)


def fp8_share(share: slice, name: str = "") -> slice:
    """The scale blocks (of FP8_BLOCK rows or columns) of a share of an FP8 weight's rows or columns. Exact
    only when the share starts on a block boundary or lies inside one block: otherwise one of its blocks would
    need the scales of two (a ValueError naming the linear)."""
    start, stop = share.start, share.stop
    if start % FP8_BLOCK and start // FP8_BLOCK != (stop - 1) // FP8_BLOCK:
        raise ValueError(f"linear_format fp8 across ranks: {name or 'a linear'}'s share [{start}, {stop}) of a rank "
                         f"cuts a {FP8_BLOCK}-wide scale block; use a tensor_parallel_size whose shares start on "
                         f"multiples of {FP8_BLOCK}, or linear_format dequantized")
    return slice(start // FP8_BLOCK, -(-stop // FP8_BLOCK))


def _attention_shares(cfg: ModelConfig, m: ParallelMapping) -> dict[str, slice]:
    """This rank's rows of wq_b and wo_a and columns of wo_b (attention TP)."""
    t, tr = m.attn_tp, (m.rank if m.attn_tp > 1 else 0)
    heads, groups, o = _share(cfg.num_heads, t, tr), _share(cfg.o_groups, t, tr), cfg.o_lora_rank
    group_rows = slice(groups.start * o, groups.stop * o)
    return {"wq_b": slice(heads.start * cfg.head_dim, heads.stop * cfg.head_dim), "wo_a": group_rows,
            "wo_b": group_rows}


def check_fp8_shards(cfg: ModelConfig, m: ParallelMapping) -> None:
    """Refuse (ValueError) an attention split whose FP8 shares would cut scale blocks, for every rank."""
    if m.attn_tp > 1:
        for r in range(m.attn_tp):
            for name, share in _attention_shares(cfg, m.with_rank(r)).items():
                fp8_share(share, name)


def rank_experts(cfg: ModelConfig, m: ParallelMapping) -> range:
    """The routed experts rank ``m.rank`` holds (global ids)."""
    s = _share(cfg.n_routed_experts, m.ep, m.ep_rank)
    return range(s.start, s.stop)


def _expert_rows(x: torch.Tensor, cfg: ModelConfig, m: ParallelMapping) -> slice:
    """Rows of this rank's experts in ``x``: every expert ([E, ...]) or this rank's already ([E / ep, ...],
    fewer rows than E whenever ep > 1)."""
    if x.shape[0] == cfg.n_routed_experts:
        return _share(cfg.n_routed_experts, m.ep, m.ep_rank)
    return slice(0, x.shape[0])


def shard_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, m: ParallelMapping) -> dict[str, torch.Tensor]:
    """This rank's tensors (copies of the slices, so the full tensors can be freed). The routed experts may
    come with every expert ([E, ...]) or, as ``load_state(..., experts=rank_experts(...))`` reads them, with
    this rank's only ([E / ep, ...])."""
    t, tr = m.attn_tp, (m.rank if m.attn_tp > 1 else 0)
    heads = _share(cfg.num_heads, t, tr)
    att = _attention_shares(cfg, m)
    inter = _share(cfg.moe_inter_dim, m.moe_tp, m.moe_tp_rank)
    if is_packed(sd):
        check_fp4_shapes(cfg.hidden_size, inter.stop - inter.start, f" / moe_tp ({m.moe_tp})")
    out = {}
    for name, x in sd.items():
        if t > 1 and (hit := _ATTN_SPLIT.match(name)):
            kind = hit.group(2)
            share = att[kind] if hit.group(3) == "weight" else fp8_share(att[kind], name)
            x = x[:, share] if kind == "wo_b" else x[share]
        elif t > 1 and _SINK.match(name):  # [H]
            x = x[heads]
        elif _W13.match(name):  # [E, I, d]
            x = x[_expert_rows(x, cfg, m), inter]
        elif _W2.match(name):  # [E, d, I]; packed: [E, d, I/2] bytes, [E, d, I/32] scales
            per = cfg.moe_inter_dim // x.shape[-1]
            x = x[_expert_rows(x, cfg, m), :, inter.start // per:inter.stop // per]
        else:
            out[name] = x
            continue
        out[name] = x.clone()
    return out


class RowParallelLinear(Linear):
    """``wo_b`` over this rank's input columns (its heads' groups); the partial outputs are summed."""

    def __init__(self, in_features: int, out_features: int, comm: Collectives):
        super().__init__(in_features, out_features, bias=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class ParallelExperts(StackedExperts):
    """This rank's routed experts (global ids ``first_expert .. first_expert + E_local - 1``, intermediate
    slice of width I_local): every rank routes its tokens with the replicated gate, computes its experts'
    contributions, and the contributions are summed over ranks.

    ``gather_tokens`` (attention DP): each rank holds only its own tokens, so the tokens, weights and ids of
    all ranks are all-gathered first (every rank pads to the same count), and after the sum each rank keeps
    its own rows (reduce-scatter). Returns fp32 [N, d] like ``Experts``. On CUDA the local experts run the
    device-side grouped GEMM (graph-safe), on the CPU its torch-loop twin.
    """

    def __init__(self, cfg: ModelConfig, num_local: int, first_expert: int, inter_local: int,
                 comm: Collectives, gather_tokens: bool):
        super().__init__()
        d = cfg.hidden_size
        self.limit = cfg.swiglu_limit
        self.first_expert, self.num_local = first_expert, num_local
        self.comm, self.gather_tokens = comm, gather_tokens
        self.grouped_kernel = kernels.enabled()
        self._make_weights(num_local, inter_local, d)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, add: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``Experts.forward``'s contract: the ranks' summed contributions plus ``add``, in ``out_dtype``."""
        if self.gather_tokens:
            x, weights, ids = (self.comm.all_gather(t) for t in (x, weights, ids))
            return add_to(self.comm.reduce_scatter(self._local(x, weights, ids)), add, out_dtype)
        return add_to(self.comm.all_reduce(self._local(x, weights, ids)), add, out_dtype)

    def _local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Contributions of this rank's experts: fp32 [N, d], zeros for tokens routed elsewhere.

        On CUDA the device-side grouped GEMM (no host sync: CUDA-graph safe); the torch loop is its twin."""
        if x.is_cuda and self.grouped_kernel:
            return self._local_grouped(x, weights, ids)
        return self._local_loop(x, weights, ids)

    def _local_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> local ones; pairs routed to other ranks are masked out of the grouped GEMM
        (skipped row blocks, contribution 0). Static shapes, no .tolist() / bincount / boolean indexing."""
        from ..kernels.moe import grouped_experts  # lazy: kernels import model.ops

        local = ids - self.first_expert
        keep = (local >= 0) & (local < self.num_local)
        return grouped_experts(x, weights, local, self.w1, self.w2, self.w3, self.limit, keep=keep,
                               scales=self.scales(), invariant=rows_active(), fold=self.fold)

    def _local_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The plain-torch twin (host-side loop over this rank's experts; syncs: not for CUDA graphs)."""
        N, k = ids.shape
        local = ids.flatten() - self.first_expert  # [N*k] one row per (token, choice)
        mine = ((local >= 0) & (local < self.num_local)).nonzero().squeeze(1)
        order = local[mine].argsort(stable=True)  # grouped by expert, token order inside a group
        rows = mine[order]
        counts = torch.bincount(local[rows], minlength=self.num_local).tolist()
        tok = rows // k
        xs = x[tok]
        ws = weights.flatten()[rows].unsqueeze(-1)
        y = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c:
                seg = slice(start, start + c)
                # routing weight before w2, as the single-device path does
                w1, w2, w3 = self.expert_weights(e, x.dtype)
                h = swiglu_to(xs[seg] @ w1.t(), xs[seg] @ w3.t(), self.limit, ws[seg, 0], x.dtype)
                y.index_add_(0, tok[seg], (h @ w2.t()).float())
                start += c
        return y


def _parallelize(model: DeepseekV4, cfg: ModelConfig, m: ParallelMapping, comm: Collectives) -> None:
    """Swap in the split modules (on the meta device, before the shard's tensors are adopted)."""
    D, g, o = cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    t = m.attn_tp
    for blk in list(model.layers) + list(model.mtp):
        attn = blk.attn
        if t > 1:
            H_l, g_l = cfg.num_heads // t, g // t
            attn.wq_b = Linear(cfg.q_lora_rank, H_l * D, bias=False)
            attn.attn_sink = nn.Parameter(torch.empty(H_l, dtype=torch.float32))
            attn.wo_a = Linear(cfg.num_heads * D // g, g_l * o, bias=False)
            attn.wo_b = RowParallelLinear(g_l * o, cfg.hidden_size, comm)
        if m.world_size > 1:
            E_l = cfg.n_routed_experts // m.ep
            blk.ffn.experts = ParallelExperts(cfg, E_l, m.ep_rank * E_l, cfg.moe_inter_dim // m.moe_tp, comm,
                                              gather_tokens=m.attention_dp)


def build_shard(cfg: ModelConfig, full_sd: dict[str, torch.Tensor], has_mtp: bool, m: ParallelMapping,
                comm: Collectives, device="cpu") -> DeepseekV4:
    """This rank's model: built on the meta device, split, then adopting the shard's tensors."""
    sd = shard_state_dict(full_sd, cfg, m)
    with torch.device("meta"):
        model = DeepseekV4(cfg, with_mtp=has_mtp)
        _parallelize(model, cfg, m, comm)
        adopt_layout(model, sd)
        adopt_linear_layout(model, sd)
    model.load_state_dict({k: v.to(device) for k, v in sd.items()}, strict=True, assign=True)
    return model.finish_loading(device)  # the fused projections are replicated ones
