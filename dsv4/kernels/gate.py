"""The MoE router in two kernels: the gate logits (fp32 dot products of each token with every expert's
row, a program per token and block of experts; at prefill sizes outside batch invariance, blocks of tokens
against blocks of experts on the tensor cores), then one program per token for the scores
(sqrt-softplus, sigmoid or softmax), the selection (top-k of score + bias, or the token's fixed hash
experts), the normalisation and the route scale. In torch that is about a dozen launches. The plain-torch
twin is the CPU branch of ``dsv4.model.moe.Gate.forward``."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, pdl

FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
BLOCK_E = 1  # one expert row per program: at batch 1 the experts are the only parallelism
# Inputs per step of a logits program: all of Flash's 4096 at once, so each program has its whole expert row in
# flight (at batch 1 a program per expert, 128 of them; with four dependent 1024-input steps a launch took 6.1 us
# on an H100, flash-L20-E128, and 3.5 us with one: BENCHMARKS.md, 25th session)
BLOCK_D = 4096

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter, load_weight_and_enter

    @triton.jit
    def _gate_logits(X, stride_x, W, L, N, E, d: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
                     TOKENS: tl.constexpr, PDL: tl.constexpr):
        """Grid (cdiv(N, TOKENS), expert blocks): TOKENS tokens one after another against the same expert rows
        (read again by the same program, not by one program per token), each token's sum in the same order
        whatever TOKENS is. Rows that fit one step (d <= BD, Flash's) are loaded once for all TOKENS, first, and
        under PDL RELEASE before the wait (a weight: no kernel of a step writes it)."""
        eb = tl.program_id(1)
        e = eb * BE + tl.arange(0, BE)
        me = e < E
        if d <= BD:
            cd = tl.arange(0, BD)
            w_rows = W + e[:, None] * d + cd[None, :]
            w_all = load_weight_and_enter(w_rows, me[:, None] & (cd < d)[None, :], PDL)
        else:
            enter(PDL)
        for j in range(TOKENS):
            t = tl.program_id(0) * TOKENS + j
            live = t < N
            acc = tl.zeros([BE], dtype=tl.float32)
            for d0 in range(0, d, BD):
                c = d0 + tl.arange(0, BD)
                mc = (c < d) & live
                x = tl.load(X + t.to(tl.int64) * stride_x + c, mask=mc, other=0.0).to(tl.float32)
                if d <= BD:
                    w = w_all.to(tl.float32)
                else:
                    w = tl.load(W + e[:, None] * d + c[None, :], mask=me[:, None] & mc[None, :],
                                other=0.0).to(tl.float32)
                acc += tl.sum(w * x[None, :], axis=1)
            tl.store(L + t.to(tl.int64) * E + e, acc, mask=me & live)

    @triton.jit
    def _gate_logits_mma(X, stride_x, W, L, N, E, d: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                         PDL: tl.constexpr):
        """Prefill sizes: a block of BM tokens against BE expert rows on the tensor cores (16-bit inputs, whose
        products are exact in fp32; fp32 sums, in the tensor cores' order). Expert rows are read once per BM
        tokens, the tokens once per BE experts."""
        enter(PDL)
        t = tl.program_id(0) * BM + tl.arange(0, BM)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        k = tl.arange(0, BK)
        mt, me = t < N, e < E
        acc = tl.zeros([BM, BE], dtype=tl.float32)
        for k0 in range(0, d, BK):
            mk = k0 + k < d
            x = tl.load(X + t.to(tl.int64)[:, None] * stride_x + (k0 + k)[None, :], mask=mt[:, None] & mk[None, :],
                        other=0.0)
            w = tl.load(W + e[:, None] * d + (k0 + k)[None, :], mask=me[:, None] & mk[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        tl.store(L + t.to(tl.int64)[:, None] * E + e[None, :], acc, mask=mt[:, None] & me[None, :])

    @triton.jit
    def _gate_route(L, BIAS, TID2EID, TOK, OUT_W, OUT_IDS, E, route_scale, K: tl.constexpr, KP: tl.constexpr,
                    EP: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        t = tl.program_id(0)
        ex = tl.arange(0, EP)
        me = ex < E
        logits = tl.load(L + t * E + ex, mask=me, other=0.0)
        if FUNC == 0:  # torch's softplus (threshold 20), then sqrt; log1p(u) = log(1+u) * u / ((1+u) - 1)
            u = tl.exp(tl.minimum(logits, 20.0))
            v = 1.0 + u
            log1p = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
            scores = tl.sqrt(tl.where(logits > 20.0, logits, log1p))
        elif FUNC == 1:
            scores = tl.sigmoid(logits)
        else:
            z = tl.where(me, logits, float("-inf"))
            z = tl.exp(z - tl.max(z, axis=0))
            scores = z / tl.sum(z, axis=0)
        j = tl.arange(0, KP)
        ids = tl.zeros([KP], dtype=tl.int64)
        w = tl.zeros([KP], dtype=tl.float32)
        if HASH:
            tok = tl.load(TOK + t)
            ids = tl.load(TID2EID + tok * K + j, mask=j < K, other=0)
            w = tl.sum(tl.where(ids[:, None] == ex[None, :], scores[None, :], 0.0), axis=1)
        else:  # top-k of score + bias by repeated argmax: descending, like torch.topk
            sel = tl.where(me, scores + tl.load(BIAS + ex, mask=me, other=0.0), float("-inf"))
            for i in tl.static_range(K):
                best = tl.argmax(sel, axis=0)
                ids = tl.where(j == i, best.to(tl.int64), ids)
                w = tl.where(j == i, tl.sum(tl.where(ex == best, scores, 0.0), axis=0), w)
                sel = tl.where(ex == best, float("-inf"), sel)
        if FUNC != 2:
            w = w / tl.sum(tl.where(j < K, w, 0.0), axis=0)
        tl.store(OUT_W + t * K + j, w * route_scale, mask=j < K)
        tl.store(OUT_IDS + t * K + j, ids, mask=j < K)


MMA_TOKENS = 256  # from this many tokens a step's logits run on the tensor cores (16-bit x and weight)


def use_mma(x: torch.Tensor, weight: torch.Tensor, invariant: bool) -> bool:
    """Whether the logits take ``_gate_logits_mma``: a prefill-sized step of 16-bit x and weight of one dtype,
    outside batch invariance (there every token's sum keeps the one order of ``_gate_logits``)."""
    return (not invariant and x.shape[0] >= MMA_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
          token_ids: torch.Tensor, k: int, score_func: str, route_scale: float, invariant: bool = True):
    """x [N, d], weight [E, d] -> (weights [N, k] fp32, ids [N, k] int64), as ``Gate.forward``. ``invariant``
    False lets a prefill-sized step's logits run on the tensor cores (``use_mma``): each token's sum is then
    in another order than a small step's."""
    N, d = x.shape
    E = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    logits = torch.empty(N, E, dtype=torch.float32, device=x.device)
    w = torch.empty(N, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(N, k, dtype=torch.int64, device=x.device)
    if N:
        if use_mma(x, weight, invariant):
            be = min(128, max(16, triton.next_power_of_2(E)))
            _gate_logits_mma[(triton.cdiv(N, 64), triton.cdiv(E, be))](
                x, x.stride(0), weight, logits, N, E, d=d, BM=64, BE=be, BK=64, num_warps=4, num_stages=3,
                **pdl.args())
        else:
            tokens = 1 if N <= 64 else 16  # decode: tokens x experts programs; prefill: expert rows read once per 16
            _gate_logits[(triton.cdiv(N, tokens), triton.cdiv(E, BLOCK_E))](
                x, x.stride(0), weight, logits, N, E, d=d, BE=BLOCK_E, BD=min(BLOCK_D, triton.next_power_of_2(d)),
                TOKENS=tokens, num_warps=4, **pdl.args())
        hashed = tid2eid is not None
        _gate_route[(N,)](logits, bias.float().contiguous() if bias is not None else logits,
                          tid2eid.contiguous() if hashed else ids, token_ids.contiguous() if hashed else ids,
                          w, ids, E, float(route_scale), K=k, KP=triton.next_power_of_2(k),
                          EP=triton.next_power_of_2(E), FUNC=FUNCS[score_func], HASH=hashed, num_warps=1, **pdl.args())
    return w, ids
