"""Prefill: time to first token and prefill tok/s for one prompt at a time (1k, 8k, 32k tokens by default),
with the achieved TFLOP/s against the H200's dense bf16 peak (issue 20 measures its prefill kernels with it).

TTFT here is ``LLM.generate`` of one request with ``max_tokens=1`` (the prompt prefilled in chunks of
``--chunk`` tokens, then one token sampled), the device synchronised around it, median of ``--repeat`` runs after
an untimed one. The FLOPs are counted from the config (``prefill_flops``): every projection (2 x weights per
token: attention, compressors, indexer, shared and routed experts, router, mHC), the attention's scores and
values over the keys each query sees (its window, the compressed entries: all of them at ratio 128, the indexer's
top-k at ratio 4, plus the indexer's scores over every ratio-4 entry), and the lm head at the last token only.
Random weights route tokens evenly, so the routed experts count k per token whatever their choice."""

from __future__ import annotations

import argparse
import gc
import random

from common import report, table, timed

from dsv4 import LLM, SamplingParams
from dsv4.engine.runner import ModelRunner

H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 SXM, dense (no sparsity)
H200_FP8_DENSE_TFLOPS = 1979.0


def prefill_flops(cfg, T: int) -> float:
    """Matmul FLOPs of prefilling T tokens of one sequence (multiply-adds x 2), counted from the config."""
    d, H, D, q, g, o = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, k, I, n = cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.moe_inter_dim, cfg.hc_mult
    W = cfg.window_size
    total = 0.0
    for r in cfg.compress_ratios:
        per_token = q * d + H * D * q + D * d + g * o * (H * D // g) + d * g * o  # attention projections
        per_token += (E + (1 + k) * 3 * I) * d  # router, shared expert, k routed experts
        per_token += 2 * (2 + n) * n * n * d  # mHC mixing (two sub-blocks)
        # keys seen by query t (0-based), summed over t: window min(W, t+1)
        keys = sum(min(W, t + 1) for t in range(T))
        if r:
            coff = 2 if r == 4 else 1
            per_token += 2 * coff * D * d  # compressor (kv and gate)
            if r == 4:
                dI, nI = cfg.index_head_dim, cfg.index_n_heads
                per_token += 2 * 2 * dI * d + nI * dI * q + nI * d  # the indexer's compressor, queries, weights
                entries = sum((t + 1) // 4 for t in range(T))
                total += 2 * nI * dI * entries  # the indexer scores every visible entry
                keys += sum(min(cfg.index_topk, (t + 1) // 4) for t in range(T))
            else:
                keys += sum((t + 1) // r for t in range(T))
        total += 2 * per_token * T + 2 * 2 * H * D * keys  # projections; scores and values
    return total + 2 * cfg.vocab_size * d  # the lm head at the last token


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_tokens: the prefill chunk")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch"],
                    help="torch: prefill attention in plain torch (the kernels' twin), for the ratio")
    ap.add_argument("--moe-rows", type=int, default=0, choices=[0, 16],
                    help="16: the grouped MoE keeps row blocks of 16 at every size (the earlier prefill), for the ratio")
    ap.add_argument("--grouped-mm", default="on", choices=["on", "off"],
                    help="off: the routed experts' prefill GEMMs on the Triton kernel instead of torch._grouped_mm"
                         " (moe.GROUPED_MM), for the ratio")
    ap.add_argument("--expert-format", default="dequantized", choices=["dequantized", "fp4"])
    ap.add_argument("--linear-format", default="dequantized", choices=["dequantized", "fp8"])
    ap.add_argument("--prefill-graph-sizes", type=int, nargs="*", default=None,
                    help="cuda_graph_config.prefill_token_sizes (default: the engine's; give none for no prefill graphs)")
    ap.add_argument("--mtp", type=int, nargs="+", default=[0],
                    help="MTP draft lengths to run (0: off; k: TTFT includes the MTP layer's catch-up pass and k"
                         " drafts), one engine each")
    ap.add_argument("--mtp-rows", nargs="+", default=["kept"], choices=["kept", "all"],
                    help="the MTP catch-up pass over each request's last swa_cap rows (kept, engine/mtp_rows.py) or"
                         " over every row of the chunk (all: ModelRunner.mtp_tail_rows off), for the ratio")
    ap.add_argument("--fuse-q-norm", action="store_true",
                    help="the attention's single pass norms and ropes q as it loads it (sparse_attention.FUSE_Q_NORM)")
    ap.add_argument("--no-fuse-rope-out", action="store_true",
                    help="with --fuse-q-norm: the output's inverse rope by its own kernel"
                         " (sparse_attention.FUSE_ROPE_OUT off)")
    ap.add_argument("--rescale-tau", type=float, default=None,
                    help="the attention's lazy rescale margin (sparse_attention.RESCALE_TAU; 0: every block)")
    ap.add_argument("--exp2", choices=["on", "off"], default=None,
                    help="the attention's weights as 2**x by one ex2.approx.ftz (sparse_attention.EXP2; default:"
                         " the module's, on)")
    ap.add_argument("--split-scores", choices=["on", "off"], default=None,
                    help="the attention's wide tile computes its scores once, split between the warpgroups"
                         " (sparse_attention.SPLIT_SCORES; default: the module's, on)")
    ap.add_argument("--post-mix", choices=["on", "off"], default=None,
                    help="the mHC write-back computes the next collapse's mixing partials (model.mhc.POST_MIX;"
                         " default: the module's, on)")
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    from dsv4.kernels import sparse_attention  # its switches before the engine is built: prefill graphs capture them

    if args.fuse_q_norm:
        sparse_attention.FUSE_Q_NORM = True
        sparse_attention.FUSE_ROPE_OUT = not args.no_fuse_rope_out
    if args.rescale_tau is not None:
        sparse_attention.RESCALE_TAU = args.rescale_tau
    if args.exp2:  # (set only when asked: an A/B's earlier tree may lack the switch)
        sparse_attention.EXP2 = args.exp2 == "on"
    if args.split_scores:
        sparse_attention.SPLIT_SCORES = args.split_scores == "on"
    if args.post_mix:
        from dsv4.model import mhc

        mhc.POST_MIX = args.post_mix == "on"
    if args.moe_rows:
        from dsv4.kernels import moe

        moe.block_m_for = lambda *a, **k: args.moe_rows
    if args.grouped_mm == "off":
        from dsv4.kernels import moe

        moe.GROUPED_MM = False  # before the engine is built: its prefill graphs capture the path
    rows = []
    graphs = None
    for k, mtp_rows in [(k, r) for k in args.mtp for r in (args.mtp_rows if k else ["-"])]:
        ModelRunner.mtp_tail_rows = mtp_rows != "all"
        llm = LLM(args.preset, device=args.device, dtype="bf16" if args.device == "cuda" else "fp32",
                  max_batch_size=1, max_num_tokens=args.chunk, max_seq_len=max(args.lens) + 8,
                  kv_cache_config={"free_gpu_memory_fraction": 0.5}, attention_backend=args.attention_backend,
                  moe_config={"expert_format": args.expert_format}, linear_format=args.linear_format,
                  cuda_graph_config={"prefill_token_sizes": args.prefill_graph_sizes},
                  speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
        cfg = llm.model.cfg
        graphs = llm.engine.runner.graphs
        rng = random.Random(0)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        for T in args.lens:
            prompt = [rng.randrange(2, cfg.vocab_size) for _ in range(T)]
            llm.generate([prompt], sp)  # untimed: this length's shapes compile
            t, _ = timed(lambda prompt=prompt, llm=llm: llm.generate([prompt], sp), repeat=args.repeat)
            tflops = prefill_flops(cfg, T) / t / 1e12
            rows.append([k or "off", mtp_rows, T, -(-T // args.chunk), t * 1e3, T / t, tflops,
                         f"{100 * tflops / H200_BF16_DENSE_TFLOPS:.1f}%"])
            print(rows[-1], flush=True)
        del llm
        gc.collect()
    ModelRunner.mtp_tail_rows = True
    text = table(["MTP k", "MTP pass rows", "prompt tokens", "chunks", "TTFT (ms)", "prefill tok/s",
                  "achieved TFLOP/s (target layers)", "of the bf16 dense peak (989)"], rows)
    report(f"Prefill at concurrency 1, {args.preset}, chunks of {args.chunk}, attention {args.attention_backend}, "
           f"experts {args.expert_format}, linears {args.linear_format}"
           + (f", MoE row blocks of {args.moe_rows}" if args.moe_rows else "")
           + ("" if args.grouped_mm == "on" else ", experts' prefill GEMMs on the Triton kernel")
           + (f", q norm{'' if args.no_fuse_rope_out else ' and output rope'} in the attention" if args.fuse_q_norm
              else "") + (f", rescale margin {args.rescale_tau:g}" if args.rescale_tau else "")
           + (f", EXP2 {args.exp2}" if args.exp2 else "")
           + (f", SPLIT_SCORES {args.split_scores}" if args.split_scores else "")
           + f", prefill graphs {graphs.prefill_tokens if graphs is not None else None}",
           text, args.append,
           notes="FLOPs counted from the config (bench/prefill.py: prefill_flops); random weights.")


if __name__ == "__main__":
    main()
