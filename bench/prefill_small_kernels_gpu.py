"""The small kernels of an 8k-token prefill chunk on flash-L4-E32's shapes, timed alone (CUDA events, median of
5 single launches after one untimed): q's per-head norm + rope, the output's inverse rope (out of place, and in
place on the rope channels only), the router's logits (per-token kernel, and the tensor-core kernel), the
indexer's scores over a causal prompt's compressed entries and their top-k, mHC's collapse (and in the
batch-invariant layout of its partials) and write-back. Bytes are what each kernel must move at least;
GB/s is that over its time. The script runs on an older tree too (``PYTHONPATH`` at another checkout): what that
tree lacks prints '-'.

    PYTHONPATH=$PWD python3 bench/prefill_small_kernels_gpu.py [--tokens 8192]
"""

from __future__ import annotations

import argparse
import inspect

import torch

from common import event_ms, table

from dsv4.config import get_preset
from dsv4.kernels import gate, indexer, norm, rope


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--preset", default="flash-L4-E32")
    a = ap.parse_args()
    cfg = get_preset(a.preset)
    N, H, D = a.tokens, cfg.num_heads, cfg.head_dim
    R = cfg.rope_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    pos = torch.arange(N, device=dev)
    table_ = 1.0 / (10000 ** (torch.arange(0, R, 2, device=dev).float() / R))
    q = torch.randn(N, H, D, device=dev, generator=g).to(bf)
    rows = []

    def add(name, fn, nbytes):
        if fn is None:
            rows.append([name, "-", "-", "-"])
            return
        ms = event_ms(fn)
        rows.append([name, f"{ms * 1e3:.0f}", f"{nbytes / 1e6:.0f}", f"{nbytes / ms / 1e6:.0f}"])

    qb = q.numel() * 2
    add(f"q norm + rope [{N}, {H}, {D}]", lambda: norm.rms_norm_rope(q, None, 1e-6, table_, pos), 2 * qb)
    add("inverse rope, out of place", lambda: rope.apply_rope(q, table_, pos, True), 2 * qb)
    has_in_place = "in_place" in inspect.signature(rope.apply_rope).parameters
    add("inverse rope, in place (rope channels)",
        (lambda: rope.apply_rope(q, table_, pos, True, in_place=True)) if has_in_place else None,
        2 * qb * R // D)
    x = torch.randn(N, cfg.hidden_size, device=dev, generator=g).to(bf)
    E, k = cfg.n_routed_experts, cfg.n_experts_per_tok
    w = (torch.randn(E, cfg.hidden_size, device=dev, generator=g) * 0.02).to(bf)
    bias = torch.zeros(E, device=dev)
    tok = torch.zeros(N, dtype=torch.long, device=dev)
    xb = x.numel() * 2
    route_args = (x, w, bias, None, tok, k, cfg.score_func, cfg.route_scale)
    has_mma = "invariant" in inspect.signature(gate.route).parameters
    add(f"router [{N}, {cfg.hidden_size}] x {E} experts, per-token logits",
        lambda: gate.route(*route_args, **({"invariant": True} if has_mma else {})), xb)
    add("router, tensor-core logits", (lambda: gate.route(*route_args, invariant=False)) if has_mma else None, xb)
    nI, dI, ratio = cfg.index_n_heads, cfg.index_head_dim, 4
    Ecols = N // ratio
    qi = torch.randn(N, nI, dI, device=dev, generator=g).to(bf)
    wi = torch.randn(N, nI, device=dev, generator=g).to(bf)
    keys = torch.randn(Ecols + 1, dI, device=dev, generator=g).to(bf)
    cols = torch.arange(Ecols, device=dev)
    erows = (cols + 1).expand(N, Ecols).contiguous()
    valid = (cols[None, :] < ((pos + 1) // ratio)[:, None]).contiguous()  # a causal prompt's closed windows
    visible = int(valid.sum())
    tiles = "invariant" in inspect.signature(indexer.index_scores_cuda).parameters
    add(f"indexer scores [{N}, {nI}, {dI}] x {Ecols} entries (causal), a token at a time",
        lambda: indexer.index_scores_cuda(qi, wi, keys, erows, valid, **({"invariant": True} if tiles else {})),
        visible * dI * 2 + N * Ecols * 4)
    add("indexer scores, tiles of tokens x entries",
        (lambda: indexer.index_scores_cuda(qi, wi, keys, erows, valid)) if tiles else None, N * Ecols * 4)
    scores = indexer.index_scores_cuda(qi, wi, keys, erows, valid)
    add(f"indexer top-{cfg.index_topk} of them", lambda: indexer.topk_rows_cuda(scores, erows, cfg.index_topk),
        N * Ecols * 4)
    from dsv4.kernels import mhc
    X = torch.randn(N, cfg.hc_mult, cfg.hidden_size, device=dev, generator=g).to(bf)
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    fn = torch.randn(mix, cfg.hc_mult * cfg.hidden_size, device=dev, generator=g) * 0.01
    base, sc = torch.zeros(mix, device=dev), torch.ones(3, device=dev)
    add(f"mHC collapse [{N}, {cfg.hc_mult}, {cfg.hidden_size}] (mixing partials, collapse, Sinkhorn)",
        lambda: mhc.hc_pre(X, fn, base, sc, 20, 1e-6, 1e-6), X.numel() * 2 + N * cfg.hidden_size * 2)
    looped = "invariant" in inspect.signature(mhc.hc_pre).parameters
    add("mHC collapse, one chunk of inputs a partial program (the batch-invariant layout)",
        (lambda: mhc.hc_pre(X, fn, base, sc, 20, 1e-6, 1e-6, invariant=True)) if looped else None,
        X.numel() * 2 + N * cfg.hidden_size * 2)
    y = torch.randn(N, cfg.hidden_size, device=dev, generator=g).to(bf)
    post = torch.rand(N, cfg.hc_mult, device=dev, generator=g)
    comb = torch.rand(N, cfg.hc_mult, cfg.hc_mult, device=dev, generator=g)
    add("mHC write-back", lambda: mhc.hc_post(y, X, post, comb), 2 * X.numel() * 2 + y.numel() * 2)
    print(f"{torch.cuda.get_device_name()}, {a.preset}, {N} tokens")
    print(table(["kernel", "us", "MB moved (least)", "GB/s"], rows))


if __name__ == "__main__":
    main()
