"""MTP on vs off (k = 1, 2): output tok/s and acceptance. Random weights give near-zero acceptance, so a
test-only drafter that replaces the MTP's drafts with the known greedy answer a given fraction of the time
(``proposer.use_known_answers``: on the device, so MTP steps still overlap) shows what the mechanism buys at
that acceptance. ``--sync`` adds each MTP row again with the overlap scheduler off, ``--separate`` with the
separate CUDA graphs (target, MTP passes, acceptance eager between) instead of the whole-step graph, in the same
run. ``--pause on off`` runs each MTP row with the engine's drafting pause (``engine/spec_pause.py``, the
default) and without it, in the same run: at zero acceptance the pause is what keeps MTP close to off."""

from __future__ import annotations

import argparse
import gc
import random
import statistics

import torch

from common import report, table, timed
from decode_floor import CHECKPOINT_FP4, STORED_FP8, add_switches, apply_switches, mtp_step_ratio

from dsv4 import LLM, SamplingParams
from dsv4.config import get_preset
from dsv4.engine.proposer import use_known_answers
from dsv4.engine.spec_pause import DraftPause


@torch.no_grad()
def _divergence_gap(model, prompts, outs, ref) -> str:
    """At each request's first divergence from MTP off, the dense reference model's (teacher-forced, MTP-off
    prefix) logit difference between the two tokens; beside it the median top-1/top-2 gap over the positions
    before it, for scale. A near-tie shows as a gap far below the median."""
    gaps, typical = [], []
    for p, o in zip(prompts, outs):
        r = ref[tuple(p)]
        i = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None)
        if i is None:
            continue
        ids = torch.tensor([p + r[:i]], device=model.embed.weight.device)
        logits = model(ids)[0].float()
        gaps.append(abs((logits[-1, r[i]] - logits[-1, o[i]]).item()))
        top2 = logits[len(p) - 1:].topk(2, dim=-1).values
        typical.append((top2[:, 0] - top2[:, 1]).median().item())
    if not gaps:
        return "none"
    return f"{min(gaps):.3f} ({statistics.median(typical):.3f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1],
                    help="requests in flight (one model build per k serves every concurrency)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--p-right", type=float, nargs="*", default=[0.8],
                    help="oracle drafter rows: the chance each draft is the known answer (none: MTP rows only)")
    ap.add_argument("--no-gap", action="store_true",
                    help="skip the logit-gap column (it keeps MTP off's model alive beside the next one: a model"
                         " of Flash's depth does not fit twice)")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per row (the median is reported)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="EngineConfig.batch_invariant: bf16 MTP on then equals MTP off, so the oracle drafter's"
                         " reference holds at any concurrency")
    ap.add_argument("--sync", action="store_true",
                    help="also every MTP row with the overlap scheduler off (each step reads its own verdict)")
    ap.add_argument("--separate", action="store_true",
                    help="also each k > 0 with the separate graphs instead of the whole-step graph")
    ap.add_argument("--expert-format", default="dequantized", choices=["dequantized", "fp4"])
    ap.add_argument("--linear-format", default="dequantized", choices=["dequantized", "fp8"])
    ap.add_argument("--pause", nargs="+", default=["on"], choices=["on", "off"],
                    help="each MTP row with the engine's drafting pause (on: its default policy) and/or without it")
    add_switches(ap)
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    on = apply_switches(args)
    if args.ks[0] != 0:
        ap.error("--ks must start with 0: MTP off is the reference (its tokens and its speed)")
    cfg = get_preset(args.preset)
    # element sizes of the weights as this run stores them (decode_floor.step_bytes), for the bandwidth ceiling
    precision = dict(expert_elt=CHECKPOINT_FP4 if args.expert_format == "fp4" else 2,
                     fp8_elt=STORED_FP8 if args.linear_format == "fp8" else None)
    rng = random.Random(0)
    most = max(args.concurrency)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(most)]
    sp = SamplingParams(max_tokens=args.gen, ignore_eos=True)
    common = dict(device=args.device, dtype="bf16" if args.device == "cuda" else "fp32",
                  max_batch_size=most, max_num_tokens=4096, max_seq_len=args.prompt_len + args.gen + 8,
                  kv_cache_config={"free_gpu_memory_fraction": 0.2}, batch_invariant=args.batch_invariant,
                  moe_config={"expert_format": args.expert_format}, linear_format=args.linear_format)
    rows = []
    ref: dict = {}  # prompt -> MTP off's tokens (the same at every concurrency only when batch-invariant)
    off_speed: dict[int, float] = {}
    ref_model = None
    for k in args.ks:
        llm = LLM(args.preset, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None,
                  **common)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # untimed: compiles this run's kernels
        policy = llm.engine.pause  # (--pause off: None for the row, restored after)
        for c in args.concurrency:
            batch = prompts[:c]
            drafters = [("MTP", None)] + ([] if k == 0 else [(f"oracle p={p}", p) for p in args.p_right])
            modes = [(label, p, ov, whole, pause) for label, p in drafters
                     for ov in ((True, False) if k and args.sync else (True,))
                     for whole in ((True, False) if k and args.separate else (True,))
                     for pause in (args.pause if k else ["-"])]
            for label, p, overlap, whole, pause in modes:
                llm.engine.pause = policy if pause == "on" else None
                use_known_answers(llm.engine, ref[c] if p is not None else None, p or 0.0)
                llm.engine.overlap_scheduler = overlap
                if llm.engine.runner.graphs is not None:  # no name outlives ``del llm`` below: it holds the model
                    llm.engine.runner.graphs.whole_step = whole and k > 0
                llm.engine.reset_stats()
                t, out = timed(lambda llm=llm, batch=batch: llm.generate(batch, sp), repeat=args.repeat)
                toks = [o.outputs[0].token_ids for o in out]
                if k == 0:
                    ref[c] = {tuple(q): o for q, o in zip(batch, toks)}
                    off_speed[c] = c * args.gen / t
                pairs = [(ref[c][tuple(q)], o) for q, o in zip(batch, toks)]
                same = sum(a == b for r, o in pairs for a, b in zip(r, o)) / sum(len(r) for r, _ in pairs)
                first = min(next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in pairs)
                if k == 0 and not args.no_gap:
                    ref_model = llm.model
                gap = ("-" if k == 0 or p is not None or ref_model is None
                       else _divergence_gap(ref_model, batch, [o for _, o in pairs], ref[c]))
                st = llm.get_stats()["speculative"] or {}
                speed = c * args.gen / t
                paused, num_paused = "-", 0
                if isinstance(llm.engine.pause, DraftPause):  # (its counts since reset_stats: every timed run)
                    num_paused = llm.engine.pause.as_dict()["num_paused_steps"]
                    paused = f"{num_paused} / {llm.engine.num_steps}"
                tokens = st.get('mean_accepted_len', 1)
                ceiling = (f"{tokens / mtp_step_ratio(cfg, c, k, args.prompt_len + args.gen // 2, **precision):.2f}x"
                           if k and not num_paused else "-")  # (a paused step reads MTP off's bytes)
                rows.append([c, k, label if k else "off", "on" if overlap else "off",
                             ("whole" if whole else "separate") if k else "-", pause, paused, speed,
                             f"{speed / off_speed[c]:.2f}x", ceiling,
                             f"{st.get('acceptance_rate', 0):.2f}", f"{tokens:.2f}",
                             f"{same:.3f}", first, gap])
                print(rows[-1], flush=True)  # (a run stopped part way keeps its rows)
        use_known_answers(llm.engine, None)
        del llm  # before the next model is built: a model of Flash's depth fits once
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    text = table(["concurrency", "k", "drafts", "overlap", "step graph", "drafting pause",
                  "paused steps / steps", "output tok/s", "vs off", "bandwidth ceiling", "acceptance",
                  "mean accepted len",
                  "tokens identical to MTP off", "first divergence",
                  "logit gap there (top-2 gap, median elsewhere)"], sorted(rows, key=lambda r: r[0]))
    report(f"MTP on vs off, {args.preset}, {args.gen} output tokens, routed experts {args.expert_format}, linears"
           f" {args.linear_format}"
           + (", batch-invariant" if args.batch_invariant else "") + "".join(f", {o}" for o in on), text,
           args.append, notes="Random weights: the real MTP layer is almost never right; the oracle rows show the"
                              " speed-up at a known acceptance (meaningful where MTP on gives MTP off's tokens)."
                              " Bandwidth ceiling: the row's tokens a step over the bytes its step reads against"
                              " MTP off's (decode_floor.mtp_step_ratio: the verify rows route to more distinct"
                              " experts, and each draft pass reads the MTP layer and the head): its speed-up if"
                              " both ran at the memory-bandwidth floor; '-' where steps were paused.")


if __name__ == "__main__":
    main()
