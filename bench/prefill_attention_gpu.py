"""Sparse sink attention at prefill sizes: the single-pass kernel's tiles (heads per program BLOCK_H, keys per
step BLOCK_K, warps, pipeline stages) on one 8k-token chunk of Flash's shapes
(64 heads of 512, bf16), for the three layer kinds: the window alone (128 keys a token), HCA (the window and
the token's ratio-128 entries: 64 columns) and CSA (the window and the indexer's 512 entries). The window keys
are rows t-127..t of the combined space (ring copy, then the chunk's rows), the entries random rows of the
ones the token sees (a row of the real layout), so the keys a chunk reads fit L2 as in the engine.

Each tile is checked first against the float64 torch twin on 256 tokens of the chunk; then timed with CUDA
events, median of 5 (each one launch). TFLOP/s counts the valid keys: 4 H D flops a (query, key) pair.
"auto" is the path sparse_sink_attention takes (split or single pass, its tile), "default tile" the single pass
with the tile it takes when no tile is given."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
from common import event_ms, report, table

if importlib.util.find_spec("dsv4") is None:  # run from bench/ without PYTHONPATH: the repository root
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4.kernels import sparse_attention as sa

TILES = ["auto", None, (16, 32, 8, 2), (16, 64, 8, 2), (32, 32, 8, 2), (64, 32, 8, 1), (64, 32, 8, 2),
         (64, 64, 8, 1), (64, 64, 8, 2), (64, 64, 8, 3), (64, 16, 8, 3), (64, 128, 8, 1), (64, 64, 4, 2),
         (64, 64, 16, 2)]


def chunk(N, H, D, W, kind, g, start=0, hot=False):
    """q, sources and the sink of one N-token chunk whose first token is at position ``start``. ``hot``: every
    token's entries name the first 64 rows (a diagnosis: the same keys for every token, always in L2)."""
    q = torch.randn(N, H, D, device="cuda", generator=g).bfloat16()
    pos = start + torch.arange(N, device="cuda")
    win = torch.randn(N + W, D, device="cuda", generator=g).bfloat16()  # the ring copy (W rows), the chunk's
    key_pos = pos[:, None] - W + 1 + torch.arange(W, device="cuda")[None, :]  # positions t-127..t
    i1 = (key_pos - start + W).clamp(min=0)
    v1 = key_pos >= 0
    sources = [(win, i1, v1)]
    if kind != "window":
        ratio = 128 if kind == "HCA" else 4
        R2 = max((start + N) // ratio, 1)
        K2 = R2 if kind == "HCA" else 512
        rows = torch.randn(R2, D, device="cuda", generator=g).bfloat16()
        seen = (pos + 1) // ratio  # entries token t sees
        if kind == "HCA":
            i2 = torch.arange(K2, device="cuda")[None, :].expand(N, K2).contiguous()
            v2 = i2 < seen[:, None]
        else:
            i2 = (torch.rand(N, K2, device="cuda", generator=g) * seen.clamp(min=1)[:, None]).long()
            v2 = torch.arange(K2, device="cuda")[None, :] < seen[:, None]
        if hot:
            i2 = i2 % min(64, R2)
        sources.append((rows, i2, v2))
    sink = torch.randn(H, device="cuda", generator=g)
    return q, sources, sink


def q_norm_rows(N, kind, q, sources, sink, scale, sub, flops):
    """The raw-q path (``q_norm``) three ways: the norm's kernel, the attention and the rope's kernel; the single
    pass with the norm in its prologue and the rope's kernel after; the single pass doing both. Each checked
    against the float64 twin of norm, rope, attention and inverse rope on the chunk's last 256 tokens."""
    from dsv4.model.ops import Rope, apply_rope, rms_norm

    R = 64
    table = 1.0 / (10000 ** (torch.arange(0, R, 2, device="cuda").float() / R))
    rope = Rope(table, torch.arange(N, device="cuda"))
    r64 = Rope(table.double(), rope.positions[sub])
    qn = apply_rope(rms_norm(q[sub].double(), None, 1e-6), r64)
    ref = sa.sparse_sink_attention_ref(qn, [(r.double(), i[sub], v[sub]) for r, i, v in sources], sink.double(), scale)
    ref = apply_rope(ref, r64, inverse=True)
    out, rope_out_default = [], sa.FUSE_ROPE_OUT
    for name, fuse, rope_out in [("q norm, attention, rope: three kernels", False, True),
                                 ("q norm in the prologue, rope's kernel after", True, False),
                                 ("q norm in the prologue, rope in the epilogue", True, True)]:
        sa.FUSE_ROPE_OUT = rope_out
        fn = lambda fuse=fuse: sa._sparse_sink_attention(q, sources, sink, scale, q_norm=(1e-6, rope), fuse=fuse)
        err = ((fn()[sub].double() - ref).abs().max() / ref.abs().max()).item()
        ms = event_ms(fn)
        out.append([N, kind, name, f"{err:.1e}", f"{ms:.3f}", f"{flops / ms / 1e9:.0f}"])
    sa.FUSE_ROPE_OUT = rope_out_default
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--start", type=int, default=0, help="position of the chunk's first token (8192: a decode-like"
                    " step late in a sequence, every key valid)")
    ap.add_argument("--kinds", nargs="+", default=["window", "HCA", "CSA"])
    ap.add_argument("--tiles", nargs="*", default=None, help="tiles to try, each BLOCK_H/BLOCK_K/warps/stages"
                    " (default: a sweep; the default tile is always timed)")
    ap.add_argument("--skip", nargs="*", default=["3"],
                    help="the single pass's SKIP values to time (sparse_attention.SKIP: 0 none; bits 1, 2: the window"
                         " source, the compressed source)")
    ap.add_argument("--hot", action="store_true", help="also each kind with every token's entries in the same 64 rows")
    ap.add_argument("--tau", type=float, nargs="*", default=[0.0],
                    help="the single pass's lazy rescale margins to time (sparse_attention.RESCALE_TAU; 0: every"
                         " block)")
    ap.add_argument("--exp2", nargs="*", default=["off"], choices=["off", "on"],
                    help="the single pass's weights as 2**x by one ex2.approx.ftz (sparse_attention.EXP2), to time")
    ap.add_argument("--split-scores", nargs="*", default=["off"], choices=["off", "on"],
                    help="the wide tile's scores computed once, split between the warpgroups"
                         " (sparse_attention.SPLIT_SCORES), to time")
    ap.add_argument("--q-norm", action="store_true",
                    help="also the path the engine takes for a raw q: its norm + rope, the attention and the output's"
                         " inverse rope as three kernels, against the single pass doing all three (FUSE_Q_NORM), and"
                         " the fused prologue alone (FUSE_ROPE_OUT off)")
    ap.add_argument("--append", default=None)
    a = ap.parse_args()
    defaults = sa.SKIP, sa.RESCALE_TAU, sa.EXP2, sa.SPLIT_SCORES  # restored after each case's sweep
    H, D, W = 64, 512, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = D ** -0.5
    rows_out = []
    cases = [(n, k, False) for n in a.tokens for k in a.kinds]
    cases += [(n, k, True) for n in a.tokens for k in a.kinds if a.hot and k == "CSA"]
    for N, kind, hot in cases:
        q, sources, sink = chunk(N, H, D, W, kind, g, a.start, hot)
        kind = kind + (" (hot rows)" if hot else "")
        pairs = sum(int(v.sum()) for _, _, v in sources)
        flops = 4 * H * D * pairs
        sub = slice(max(N - 256, 0), N)  # the last 256 tokens
        ref = sa.sparse_sink_attention_ref(q[sub].double(), [(r.double(), i[sub], v[sub]) for r, i, v in sources],
                                           sink.double(), scale)
        tiles = TILES if a.tiles is None else ["auto", None] + [tuple(int(x) for x in t.split("/")) for t in a.tiles]
        for tile, skip, tau, e2, sp in [(t, v, u, x, y) for y in a.split_scores for x in a.exp2 for u in a.tau
                                        for v in a.skip for t in tiles]:
            sa.SKIP, sa.RESCALE_TAU, sa.EXP2, sa.SPLIT_SCORES = int(skip), tau, e2 == "on", sp == "on"
            name = {"auto": "auto (the path taken)", None: "single pass, default tile"}.get(tile) or "/".join(
                str(x) for x in tile)
            name += (f", SKIP {skip}" + (f", TAU {tau:g}" if tau else "") + (", EXP2" if sa.EXP2 else "")
                     + (", SPLIT_SCORES" if sa.SPLIT_SCORES else ""))
            try:
                if tile == "auto":
                    fn = lambda: sa.sparse_sink_attention(q, sources, sink, scale)
                else:
                    fn = lambda tile=tile: sa._sparse_sink_attention(q, sources, sink, scale, split=0, tile=tile)
                err = ((fn()[sub].double() - ref).abs().max() / ref.abs().max()).item()
                ms = event_ms(fn)
            except Exception as e:  # a tile that does not compile (registers, shared memory) is reported
                rows_out.append([N, kind, name, f"failed: {type(e).__name__} {str(e)[:60]}", "", ""])
                continue
            rows_out.append([N, kind, name, f"{err:.1e}", f"{ms:.3f}", f"{flops / ms / 1e9:.0f}"])
        sa.SKIP, sa.RESCALE_TAU, sa.EXP2, sa.SPLIT_SCORES = defaults
        if a.q_norm:
            rows_out += q_norm_rows(N, kind, q, sources, sink, scale, sub, flops)
        del q, sources
    report(f"Sparse sink attention, chunks from position {a.start}, H={H} D={D}, bf16: single-pass tiles",
           table(["tokens", "layer kind", "BLOCK_H/BLOCK_K/warps/stages, SKIP", "rel err vs fp64", "ms",
                  "TFLOP/s"], rows_out), a.append)


if __name__ == "__main__":
    main()
