"""One multi-rank cell on the GPUs against the single-process engine on the same weights (greedy).

    python3 bench/multirank_gpu.py --mode tp2+ep2 --mtp 2 --graphs on [--overlap on] [--model tiny --dtype fp32]

Prints one table row: mapping, MTP, CUDA graphs, whether steps overlapped (the overlap scheduler; with several
ranks steps without MTP only), graph replays on the driver, requests, tokens identical to one process, first
divergence, seconds; with MTP, the drafting pause's counters (random weights: paused after a few steps; a probe
every 32 paused steps, so ``--max-tokens`` above 40 or so sees one) and the keep-up buckets' replays. A hang is bounded by the caller's ``timeout``; with
``DSV4_DUMP_STACKS_S`` set every rank prints its Python stacks first (see dsv4/parallel/comm.py).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4 import LLM, SamplingParams  # noqa: E402

MODES = {
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"moe_expert_parallel_size": 2},
    "tp2+ep2": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2},
    "adp2+ep2": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2, "enable_attention_dp": True},
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--mode", default="tp2+ep2", choices=sorted(MODES))
    p.add_argument("--mtp", type=int, default=2, help="draft length (0: MTP off)")
    p.add_argument("--graphs", default="on", choices=["on", "off"])
    p.add_argument("--overlap", default="on", choices=["on", "off"], help="off: disable_overlap_scheduler")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    a = p.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in [3, 17, 70, 130, 9, 40, 5, 64][:a.requests]]
    kw = dict(device=a.device, dtype=a.dtype, max_batch_size=8, max_num_tokens=256, max_seq_len=512,
              kv_cache_config={"max_tokens": 8192, "dtype": "auto"},
              cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4, 8]},
              enforce_eager=a.graphs == "off", disable_overlap_scheduler=a.overlap == "off")
    if a.mtp:
        kw["speculative_config"] = {"decoding_type": "MTP", "num_nextn_predict_layers": a.mtp}
    sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)

    with LLM(a.model, **kw) as one:
        ref = [list(o.outputs[0].token_ids) for o in one.generate(prompts, sp)]
    t0 = time.perf_counter()
    with LLM(a.model, **kw, **MODES[a.mode]) as llm:
        t1 = time.perf_counter()
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
        t2 = time.perf_counter()
        g = llm.engine.runner.graphs
        replays = g.num_replays if g is not None else 0
        overlapped = llm.engine.overlaps_steps
        notes = llm.notes
        pause = llm.get_stats().get("speculative", {}).get("pause")
        keep = getattr(llm.engine.runner, "keep_graphs", None)
    same = sum(o == r for o, r in zip(outs, ref))
    firsts = [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), None) for o, r in zip(outs, ref)]
    first = min((f for f in firsts if f is not None), default=None)
    print(f"| {a.mode} | {a.mtp} | {a.graphs} | {'yes' if overlapped else 'no'} | {replays} | {len(prompts)} |"
          f" {same}/{len(prompts)} |"
          f" {first if first is not None else '-'} | start {t1 - t0:.0f} s, generate {t2 - t1:.1f} s |")
    for n in notes:
        print("note:", n)
    if pause is not None:  # drafting paused (random weights: drafts rejected), the one-row buckets replayed
        print(f"pause: {pause}; keep-up bucket replays on the driver: {keep.num_replays if keep else None}")


if __name__ == "__main__":
    main()
