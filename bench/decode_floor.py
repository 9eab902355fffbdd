"""Decode step time against the memory-bandwidth floor: the bytes a decode step must read (weights of the
layers, the experts the batch routes to, the lm head, the KV it attends to) over the measured device copy
bandwidth. Batch sizes 1 and 32, no MTP."""

from __future__ import annotations

import argparse
import random
import statistics
import time


from common import copy_bandwidth, report, sync, table, timed

from dsv4 import LLM, SamplingParams
from dsv4.config import get_preset
from dsv4.kernels import bf16_gemv, fp4_gemv, fp8_linear, pdl
from dsv4.model import mhc, moe


CHECKPOINT_FP8 = 1 + 1 / 128 ** 2  # bytes per weight of DeepSeek's FP8 linears: e4m3, an e8m0 scale per 128x128
CHECKPOINT_FP4 = 0.5 + 1 / 32  # the routed experts: e2m1 pairs, an e8m0 scale per 32 inputs
STORED_FP8 = 1 + 4 / 128 ** 2  # the engine's FP8 linears (linear_format fp8): e4m3, a float32 scale per block


def step_bytes(cfg, batch: int, context: int, elt: int = 2, expert_elt: float = 2,
               fp8_elt: float | None = None) -> dict[str, float]:
    """Bytes one decode step of ``batch`` tokens must read, counted from the config: bf16 weights, the routed
    experts at ``expert_elt`` bytes per weight (``stored_bytes_per_expert_weight``: 2 in bf16, 0.53 packed FP4),
    the linears DeepSeek ships in FP8 (attention wq_a/wq_b/wkv/wo_a/wo_b, the indexer's wq_b, the shared expert)
    at ``fp8_elt`` (default ``elt``: dequantised at load). The checkpoint's own precision: fp8_elt=CHECKPOINT_FP8,
    expert_elt=CHECKPOINT_FP4."""
    d, H, D, q, g, o = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, k, I, n = cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.moe_inter_dim, cfg.hc_mult
    f8 = elt if fp8_elt is None else fp8_elt
    attn = weights = experts = kv = 0.0
    for r in cfg.compress_ratios:
        a = (q * d + H * D * q + D * d + g * o * (H * D // g) + d * g * o) * f8
        if r:
            coff = 2 if r == 4 else 1
            a += 2 * coff * D * d * elt
            kv += batch * (context // r) * D * elt if r != 4 else batch * min(cfg.index_topk, context // 4) * D * elt
        if r == 4:
            dI, nI = cfg.index_head_dim, cfg.index_n_heads
            a += 2 * 2 * dI * d * elt  # the indexer's compressor writes its keys in every step
            if context // 4 > cfg.index_topk:  # with at most top-k entries all are selected: no scoring needed
                a += nI * dI * q * f8 + nI * d * elt
                kv += batch * (context // 4) * dI * elt  # the indexer scores every entry
        attn += a
        weights += E * d * elt + 3 * I * d * f8 + 2 * (2 + n) * n * n * d * 4  # gate, shared expert, mHC (fp32)
        distinct = E * (1 - (1 - k / E) ** batch)  # expected experts the batch routes to
        experts += distinct * 3 * I * d * expert_elt
        kv += batch * min(cfg.window_size, context) * D * elt
    head = cfg.vocab_size * d * elt
    return {"attention": attn, "moe shared+gate+mHC": weights, "routed experts": experts, "lm head": head,
            "kv": kv, "total": attn + weights + experts + head + kv}


def mtp_step_ratio(cfg, batch: int, k: int, context: int, **precision) -> float:
    """Bytes an MTP step of ``batch`` requests with ``k`` drafts reads (the verify pass of batch x (1 + k) rows,
    which routes to more distinct experts, then k MTP passes of ``batch`` rows: one window-only layer, its e_proj
    and h_proj, and the head) over the bytes of a decode step of ``batch`` rows. ``precision``: step_bytes'
    element sizes. At the bandwidth floor, MTP's speed-up is at most (tokens a step) / this."""
    d, elt = cfg.hidden_size, precision.get("elt", 2)
    mtp_layer = cfg.replace(num_layers=1, compress_ratios=(0,))
    mtp = step_bytes(mtp_layer, batch, context, **precision)["total"] + 2 * d * d * elt
    verify = step_bytes(cfg, batch * (1 + k), context, **precision)["total"]
    return (verify + k * mtp) / step_bytes(cfg, batch, context, **precision)["total"]


def stored_bytes_per_expert_weight(model) -> float:
    """What the loaded model holds per routed-expert weight: its experts' tensors (packed bytes and scales
    included) over their number of weights."""
    ex = model.layers[0].ffn.experts
    stored = sum(t.numel() * t.element_size() for t in ex.state_dict().values())
    return stored / (3 * ex.w1.shape[0] * model.cfg.moe_inter_dim * model.cfg.hidden_size)


def _off(module, name: str):
    return lambda: setattr(module, name, False)


def _split_fp4_tiles():
    for c in (fp4_gemv.GEMV_CONFIG, fp4_gemv.GEMV_CONFIG_GATE_UP, fp4_gemv.GEMV_CONFIG_GATE_UP_FEW):
        c["JOIN"] = False


# The A/B switches: flag, its help, what it sets before the model is built, and what the table's title says then
def _one_row_kernels():
    fp8_linear.ROW_MAX_ROWS = 1
    bf16_gemv.MAX_ROWS = 1


SWITCHES = [
    ("--separate-gate-up", "packed FP4 experts at decode sizes: w1, w3 and the SwiGLU as three launches (the A/B of"
     " the fused first half)", _off(fp4_gemv, "GATE_UP_FUSED"), "FP4 w1 / w3 / SwiGLU as three launches"),
    ("--no-pdl", "launch every kernel plainly, without programmatic dependent launch (kernels.pdl's A/B)",
     lambda: pdl.set_enabled(False), "plain launches (no PDL)"),
    ("--no-pdl-release", "no PDL early release: kernels of passes of at most 4 rows wait without releasing their"
     " successors at once, the row kernels load no weight before their wait (kernels.pdl.set_release(False))",
     lambda: pdl.set_release(False), "no PDL early release"),
    ("--pdl-release-always", "PDL early release in passes of every size, not only those of at most 4 rows"
     " (kernels.pdl.set_release(True))", lambda: pdl.set_release(True), "PDL early release in every pass"),
    ("--no-shared-overlap", "the shared expert on the main stream, not captured on a side stream"
     " (model.moe.SHARED_OVERLAP's A/B)", _off(moe, "SHARED_OVERLAP"), "shared expert on the main stream"),
    ("--no-mhc-overlap", "the mHC Sinkhorn on the main stream inside the step's graphs (model.mhc.MHC_OVERLAP's"
     " A/B)", _off(mhc, "MHC_OVERLAP"), "mHC Sinkhorn on the main stream"),
    ("--no-norm-in-collapse", "the sub-blocks' RMSNorms as launches of their own after the mHC collapse"
     " (model.mhc.NORM_IN_COLLAPSE's A/B)", _off(mhc, "NORM_IN_COLLAPSE"), "RMSNorm after the mHC collapse"),
    ("--no-fp4-join", "the FP4 GEMV's inputs split in 8 runs, not its decoded tiles joined (fp4_gemv JOIN's A/B)",
     _split_fp4_tiles, "FP4 GEMV tiles not joined"),
    ("--no-fp4-prefetch", "the FP4 GEMV loads each chunk's words when it reaches it, not a chunk ahead"
     " (fp4_gemv.PREFETCH's A/B)", _off(fp4_gemv, "PREFETCH"), "FP4 GEMV without prefetch"),
    ("--no-fp4-fold", "packed FP4 experts on the tensor-core GEMM: two products a decoded weight pair, not one"
     " (kernels.fp4_gemv.FOLD's A/B)", _off(fp4_gemv, "FOLD"), "FP4 decode with two products"),
    ("--no-bf16-row-kernel", "bf16 products of 1 to 4 rows on cuBLAS / einsum (kernels.bf16_gemv.ENABLED's A/B)",
     _off(bf16_gemv, "ENABLED"), "few-row bf16 products on cuBLAS"),
    ("--one-row-kernels", "the FP8 and bf16 row kernels take one row only, as before the twenty-seventh session:"
     " products of 2 to 4 rows on the FP8 tensor-core kernel and cuBLAS (fp8_linear.ROW_MAX_ROWS and"
     " bf16_gemv.MAX_ROWS at 1)", _one_row_kernels, "row kernels for one row only"),
    ("--no-fp8-row-kernel", "FP8 linears: one-row products on the general GEMV, 2 to 4 rows on the tensor-core"
     " kernel, not the row kernel (kernels.fp8_linear.ROW_KERNEL's A/B)", _off(fp8_linear, "ROW_KERNEL"),
     "FP8 few-row products off the row kernel"),
]


def add_switches(ap: argparse.ArgumentParser) -> None:
    """The SWITCHES as flags of ``ap`` (profile_decode.py takes them too)."""
    for flag, help_, _, _ in SWITCHES:
        ap.add_argument(flag, action="store_true", help=help_)


def apply_switches(args) -> list[str]:
    """Apply the switches ``args`` names (before the model is built) -> the title phrases of those on."""
    on = [(apply, phrase) for flag, _, apply, phrase in SWITCHES if getattr(args, flag[2:].replace("-", "_"))]
    for apply, _ in on:
        apply()
    return [phrase for _, phrase in on]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--expert-format", default="dequantized", choices=["dequantized", "fp4"])
    ap.add_argument("--linear-format", default="dequantized", choices=["dequantized", "fp8"])
    ap.add_argument("--gemv-max-rows", type=float, default=None,
                    help="packed FP4 experts: the GEMV path up to this many (token, expert) pairs per expert on"
                         f" average (default {fp4_gemv.GEMV_MAX_ROWS_PER_EXPERT})")
    add_switches(ap)
    ap.add_argument("--fp8-row-tile", default=None, metavar="BLOCK_N/BLOCK_K/PREFETCH",
                    help=f"the one-row FP8 kernel's tile (default {fp8_linear.ROW_CONFIG})")
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    on = apply_switches(args)
    if args.fp8_row_tile:
        bn, bk, pf = (int(v) for v in args.fp8_row_tile.split("/"))
        fp8_linear.ROW_CONFIG.update(BLOCK_N=bn, BLOCK_K=bk, PREFETCH=bool(pf))
    if args.gemv_max_rows is not None:
        fp4_gemv.GEMV_MAX_ROWS_PER_EXPERT = args.gemv_max_rows
    cfg = get_preset(args.preset)
    bw = copy_bandwidth()
    llm = LLM(args.preset, device="cuda", dtype="bf16", max_batch_size=max(args.batch), max_num_tokens=8192,
              max_seq_len=args.prompt_len + 3 * args.steps + 16, kv_cache_config={"free_gpu_memory_fraction": 0.2},
              moe_config={"expert_format": args.expert_format}, linear_format=args.linear_format)
    fp8_elt = STORED_FP8 if args.linear_format == "fp8" else None
    expert_elt = stored_bytes_per_expert_weight(llm.model)
    eng = llm.engine
    rng = random.Random(0)
    rows = []
    for B in args.batch:
        for i in range(B):
            eng.add_request([rng.randrange(2, cfg.vocab_size) for _ in range(args.prompt_len)],
                            SamplingParams(max_tokens=3 * args.steps + 6, ignore_eos=True))
        eng.overlap_scheduler = False
        eng.step()  # the prefill of all B
        eng.step()
        times = []  # each step on its own: the host's work and the device's add up
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            eng.step()
            sync()
            times.append(time.perf_counter() - t0)
        t_row = in_a_row(eng, args.steps, overlap=False)
        t_overlap = in_a_row(eng, args.steps, overlap=True)  # the host prepares step n+1 while step n runs
        while eng.has_unfinished_requests():
            eng.step()
        t = statistics.median(times)
        g = eng.runner.graphs
        replay = None
        if g is not None and B in g._b and "target" in g._b[B].graphs:  # the step's forward alone (GPU time)
            replay, _ = timed(g._b[B].graphs["target"].replay, repeat=20)
        b = step_bytes(cfg, B, args.prompt_len + 4, expert_elt=expert_elt, fp8_elt=fp8_elt)
        floor = b["total"] / bw
        own = step_bytes(cfg, B, args.prompt_len + 4, expert_elt=CHECKPOINT_FP4, fp8_elt=CHECKPOINT_FP8)["total"] / bw
        pct = " / ".join(f"{100 * floor / x:.1f}%" for x in (t, t_row, t_overlap))
        rows.append([B, f"{t * 1e3:.2f} / {t_row * 1e3:.2f} / {t_overlap * 1e3:.2f}", floor * 1e3, pct,
                     "-" if replay is None else f"{replay * 1e3:.2f} ({100 * floor / replay:.0f}% of floor)",
                     f"{b['total'] / 1e9:.2f}", f"{b['routed experts'] / 1e9:.2f}", f"{b['lm head'] / 1e9:.2f}",
                     f"{own * 1e3:.3f} ({100 * own / t_overlap:.1f}%)"])
    text = table(["batch", "step ms: alone / in a row / in a row, overlapped", "floor ms", "% of floor",
                  "forward alone ms (graph replay)", "GB read", "of which experts", "lm head",
                  "floor in the checkpoint's precision ms (% of it, overlapped)"], rows)
    what = (f"{args.preset}, bf16, routed experts {args.expert_format} ({expert_elt:.3f} bytes per weight as"
            f" stored), linears {args.linear_format}, {args.prompt_len}-token prompts"
            + (f", FP4 GEMV up to {fp4_gemv.GEMV_MAX_ROWS_PER_EXPERT:g} pairs per expert"
               if args.expert_format == "fp4" else "")
            + "".join(f", {phrase}" for phrase in on)
            + (f", FP8 one-row kernel tile {args.fp8_row_tile}" if args.fp8_row_tile else ""))
    report(f"Decode step vs memory-bandwidth floor, {what}", text, args.append,
           notes=f"Copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s (read + write). Experts counted"
                 " as the expected number of distinct experts B tokens route to (6 of E each). 'Alone': one"
                 " engine.step() (schedule, plan, forward, sampling, commit) with the device synchronised before"
                 " and after and the overlap scheduler off, so the host's work and the device's add up; 'in a"
                 " row': the mean of consecutive steps, the overlap scheduler off, then on ('overlapped': the"
                 " host prepares step n+1 while the device runs step n), what a decoding request sees per"
                 " token. 'Forward alone' replays the step's captured target graph with nothing else. The last"
                 " column counts the weights as DeepSeek ships them (FP8 linears, FP4 experts), whatever this run"
                 " stores: the issue's goal is stated against it.")


def in_a_row(eng, steps: int, overlap: bool) -> float:
    """Mean wall time of ``steps`` consecutive engine steps (the device synchronised only around them all)."""
    eng.overlap_scheduler = overlap
    eng.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    return (time.perf_counter() - t0) / steps


if __name__ == "__main__":
    main()
