"""Where an MTP step's time goes on the GPU: per engine step, the wall time, the GPU's busy time (the sum of its
kernels' durations under torch.profiler) and the kernels that take most of it, MTP off vs k = 1.. at each
concurrency. Busy time close to the wall time means the step is bound by the GPU's work (more rows, more experts
read, the MTP layer); a gap means the GPU waits on the host.

    python3 bench/mtp_step_gpu.py --preset flash-L43-E16 --concurrency 1 32 --ks 0 1
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import report, sync, table

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts
from dsv4.config import get_preset


def _short(name: str) -> str:
    return name if len(name) <= 48 else name[:45] + "..."


def kernel_diff(kernels: dict, top: int) -> str:
    """Per concurrency and k > 0: the kernels whose ms per step differ most from MTP off's, with launches per step
    (a kernel MTP off never runs shows 0 there), and the totals over all kernels."""
    out = []
    for (c, k), (ms, n) in sorted(kernels.items()):
        if not k or (c, 0) not in kernels:
            continue
        ms0, n0 = kernels[(c, 0)]
        names = set(ms) | set(ms0)
        delta = sorted(names, key=lambda x: -abs(ms.get(x, 0) - ms0.get(x, 0)))
        body = [[_short(x), f"{ms0.get(x, 0):.4f}", f"{ms.get(x, 0):.4f}", f"{ms.get(x, 0) - ms0.get(x, 0):+.4f}",
                 f"{n0.get(x, 0):.1f}", f"{n.get(x, 0):.1f}"] for x in delta[:top]]
        t0, t, m0, m = sum(ms0.values()), sum(ms.values()), sum(n0.values()), sum(n.values())
        body.append(["all kernels", f"{t0:.4f}", f"{t:.4f}", f"{t - t0:+.4f}", f"{m0:.1f}", f"{m:.1f}"])
        out.append(f"c = {c}, k = {k} against off (ms and launches per step):\n\n" + table(
            ["kernel", "off ms", f"k={k} ms", "delta", "off launches", f"k={k} launches"], body))
    return "\n\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash-L43-E16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--separate", action="store_true",
                    help="also each k > 0 with the separate CUDA graphs instead of the whole-step graph")
    ap.add_argument("--diff", type=int, default=0,
                    help="also a table of the N kernels whose time per step differs most from MTP off's (same"
                         " concurrency), with their launches per step")
    ap.add_argument("--no-probes", action="store_true", help="a paused engine never probes (paused steps alone)")
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    most = max(args.concurrency)
    if args.preset == "mini":  # the trained model: its held-out prompts (real acceptance)
        prompts = None
    else:
        cfg = get_preset(args.preset)
        rng = random.Random(0)
        prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(most)]
    rows, tops, kernels = [], [], {}
    for k in args.ks:
        llm = LLM(args.preset, device="cuda", dtype="bf16", max_batch_size=max(args.concurrency), max_num_tokens=4096,
                  max_seq_len=1024, kv_cache_config={"free_gpu_memory_fraction": 0.2},
                  cuda_graph_config={"enable_padding": True},
                  speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
        eng = llm.engine
        if args.no_probes and eng.pause is not None:
            eng.pause.probe_every = 10 ** 9
        if prompts is None:
            prompts = [llm._encode(p)[0] for p in heldout_prompts("mini")[:most]]
        sp = SamplingParams(max_tokens=args.gen, ignore_eos=True, detokenize=False)
        modes = [(c, w) for c in args.concurrency for w in ((True, False) if (k and args.separate) else (True,))]
        for c, whole in modes:
            if eng.runner.graphs is not None:
                eng.runner.graphs.whole_step = whole and k > 0
            llm.generate(prompts[:c], sp)  # untimed
            for p in prompts[:c]:  # prefill outside the profile: only decode / verify steps are measured
                eng.add_request(p, sp)
            while any(r.num_computed < len(r.prompt_ids) for r in eng.requests.values() if not r.finished):
                eng.step()
            eng.reset_stats()
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                while eng.has_unfinished_requests():
                    eng.step()
                sync()
                wall = time.perf_counter() - t0
            steps = max(eng.num_steps, 1)
            by_name: dict = collections.Counter()
            launches: dict = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    by_name[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                    launches[e.name] += 1
            if whole:
                kernels[(c, k)] = ({n: t / 1e3 / steps for n, t in by_name.items()},
                                   {n: m / steps for n, m in launches.items()})
            busy = sum(by_name.values()) / 1e3 / steps  # us -> ms per step
            rows.append([c, k or "off", ("whole" if whole else "separate") if k else "-", steps, 1e3 * wall / steps, busy, f"{100 * busy / (1e3 * wall / steps):.0f}%"])
            top = ", ".join(f"{_short(n)} {t / 1e3 / steps:.3f}" for n, t in by_name.most_common(args.top))
            tops.append(f"- c={c} k={k or 'off'}{'' if whole or not k else ' separate graphs'}: {top}")
            eng.requests.clear()
        del llm, eng
        gc.collect()
        torch.cuda.empty_cache()
    text = table(["concurrency", "k", "step graph", "steps", "wall ms/step", "GPU busy ms/step", "busy"], rows)
    if args.diff:
        text += "\n\n" + kernel_diff(kernels, args.diff)
    report(f"MTP step on the GPU, {args.preset}, {args.gen} output tokens", text + "\n\n" + "\n".join(tops),
           args.append, notes="Kernel time summed from torch.profiler (CUDA activity), prefill steps excluded;"
                              " the list gives each step's largest kernels (ms per step).")


if __name__ == "__main__":
    main()
