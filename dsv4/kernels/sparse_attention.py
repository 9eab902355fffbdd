"""Sparse sink attention reading the KV cache in place.

Each query token n attends to keys named by row indices into cache tensors (the sliding-window ring
rows, then the compressed entries it sees), all heads sharing the one K=V vector per key, with a per-head
sink logit in the softmax denominator:

    o[n, h] = sum_j exp(q[n,h].k_j * scale) k_j / (sum_j exp(q[n,h].k_j * scale) + exp(sink[h]))

``sparse_sink_attention_ref`` is the plain-torch twin (gather, then ``sink_attention``).
"""

from __future__ import annotations

import torch

from ..model.ops import sink_attention
from . import HAVE_TRITON


def sparse_sink_attention_ref(q: torch.Tensor, sources, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, D]; sources: [(rows [R, D], index [N, K], valid [N, K]), ...] -> [N, H, D]."""
    keys, masks = [], []
    for rows, index, valid in sources:
        keys.append(torch.where(valid[..., None], rows[index.clamp(min=0)], 0).to(q.dtype))
        masks.append(valid)
    k, m = torch.cat(keys, dim=1), torch.cat(masks, dim=1)
    return sink_attention(q.unsqueeze(1), k, m.unsqueeze(1), sink, scale).squeeze(1)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _attend_source(q, m, l, acc, n, KV, stride_kv, IDX, VAL, stride_i, K, scale,
                       D: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        offs_d = tl.arange(0, D)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_range = offs_k < K
            idx = tl.load(IDX + n * stride_i + offs_k, mask=in_range, other=0)
            ok = (tl.load(VAL + n * stride_i + offs_k, mask=in_range, other=0) != 0) & in_range
            kv = tl.load(KV + idx.to(tl.int64)[:, None] * stride_kv + offs_d[None, :], mask=ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(kv), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kv))
            s = tl.where(ok[None, :], s * scale, float("-inf"))  # [BH, BK]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m = m_new
        return m, l, acc

    @triton.jit
    def _sparse_sink_attn_kernel(Q, stride_qn, stride_qh, SINK, OUT, stride_on, stride_oh, H, scale,
                                 KV1, stride_kv1, IDX1, VAL1, stride_i1, K1,
                                 KV2, stride_kv2, IDX2, VAL2, stride_i2, K2,
                                 D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                                 IEEE: tl.constexpr):
        n = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_d = tl.arange(0, D)
        q = tl.load(Q + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
        # the sink starts the running max and contributes exp(sink - m) to the denominator, no value
        m = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
        l = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        m, l, acc = _attend_source(q, m, l, acc, n, KV1, stride_kv1, IDX1, VAL1, stride_i1, K1, scale,
                                   D, BLOCK_K, IEEE)
        m, l, acc = _attend_source(q, m, l, acc, n, KV2, stride_kv2, IDX2, VAL2, stride_i2, K2, scale,
                                   D, BLOCK_K, IEEE)
        out = acc / l[:, None]
        tl.store(OUT + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=hmask[:, None])


def sparse_sink_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """The Triton kernel (one or two key sources). q [N, H, D] (D a power of two) -> [N, H, D]."""
    if not HAVE_TRITON or not q.is_cuda:
        return sparse_sink_attention_ref(q, sources, sink, scale)
    N, H, D = q.shape
    if len(sources) == 1:
        sources = list(sources) + [(sources[0][0], sources[0][1][:, :0], sources[0][2][:, :0])]
    (kv1, i1, v1), (kv2, i2, v2) = sources
    out = torch.empty_like(q)
    if N == 0:
        return out
    i1, v1, i2, v2 = i1.contiguous(), v1.contiguous(), i2.contiguous(), v2.contiguous()
    block_h = 16
    ieee = q.dtype == torch.float32
    block_k = 16 if D >= 512 and ieee else 32
    grid = (N, triton.cdiv(H, block_h))
    _sparse_sink_attn_kernel[grid](
        q, q.stride(0), q.stride(1), sink, out, out.stride(0), out.stride(1), H, scale,
        kv1, kv1.stride(0), i1, v1, i1.stride(0), i1.shape[1],
        kv2, kv2.stride(0), i2, v2, i2.stride(0), i2.shape[1],
        D=D, BLOCK_H=block_h, BLOCK_K=block_k, IEEE=ieee, num_warps=4 if D <= 128 else 8)
    return out
