"""Where the seed's command's first steps wait: the first engine steps of a timed run (after dsv4-bench's two
warmup requests, run through the same loop), MTP off against the seed's MTP, under torch.profiler. For each step:
the host's time in ``engine.step()``, the GPU's busy time inside that call, and every host call that blocked
for more than ``--min-ms`` (synchronisations, blocking copies, allocations, module loads), every GPU idle gap that long, with its time from the run's start, and the host functions of each call with the longest
self time (summed by name) (``--stack``: Python functions too), the caching allocator's cudaMalloc / cudaFree /
retries in each call, and the Triton kernels compiled in these steps: where TTFT goes before the first tokens
come back.

    python3 first_steps_gpu.py --runs off mtp off mtp [--steps 6]

``mtp-all-rows``: the MTP pass over every prompt row instead of each request's kept rows
(``ModelRunner.mtp_tail_rows`` off), whose GEMMs have the target pass's row counts; ``mtp-unpadded``: the kept
rows not padded to the row counts warmup runs (``ModelRunner.mtp_rows_padded`` off); ``mtp-far``: drafting paused
far from the next probe when the timed requests arrive (their prompt steps skip the keep-up pass);
``mtp-drafting``: the pause reset before them (drafting: the whole MTP pass over the kept rows, then drafts);
``mtp-full-keep``: a paused step within the ring's span of the next probe keeps each request's last swa_cap rows
(as before the thirty-third session), not only those the probe will read (``DraftPause.keep_rows``);
``off-nowave``: MTP off without warmup's first-wave path (full steps of prompts beside decode rows, added in the
thirty-third session).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from common import keep_whole_span

from dsv4 import LLM, SamplingParams
from dsv4.bench.options import load_yaml
from dsv4.bench.runner import _drive
from dsv4.bench.dataset import DatasetRequest
from dsv4.config import get_preset
from dsv4.engine.runner import ModelRunner
from dsv4.engine import warmup
from dsv4.engine.spec_pause import DraftPause
from dsv4.kernels.compiles import COMPILES

KEEP_ROWS, MIXED = DraftPause.keep_rows, warmup._mixed_prompts
SEED_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "mtp.yml"


def busy(intervals):
    """Merged [start, end) intervals."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def alloc_counts(cuda: bool) -> list[int]:
    """The caching allocator's counters (CUDA): cudaMalloc and cudaFree calls, allocations retried after
    freeing the cache (a cudaFree synchronises the device), synchronisations of every stream."""
    if not cuda:
        return [0] * len(ALLOC_KEYS)
    stats = torch.cuda.memory_stats()
    return [stats.get(k, 0) for k in ALLOC_KEYS]


def self_times(events) -> list[tuple[float, float, str]]:
    """(start, self time, name) of nested host events of one thread (Python functions and torch ops): each
    event's duration less its children's, so that a long wait or a long piece of work shows where it happens."""
    out, stack = [], []  # stack: [end, start, name, children's time]
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        s, d = e["ts"], e["dur"]
        while stack and stack[-1][0] <= s:
            end, start, name, kids = stack.pop()
            out.append((start, end - start - kids, name))
        if stack:
            stack[-1][3] += d
        stack.append([s + d, s, e["name"], 0.0])
    out += [(start, end - start - kids, name) for end, start, name, kids in stack]
    return out


def run(label: str, prompts, gen: int, concurrency: int, preset: str, steps: int, min_ms: float, device: str,
        stack: bool = False):
    ModelRunner.mtp_tail_rows = label != "mtp-all-rows"
    ModelRunner.mtp_rows_padded = label != "mtp-unpadded"
    DraftPause.keep_rows = keep_whole_span(KEEP_ROWS) if label == "mtp-full-keep" else KEEP_ROWS
    warmup._mixed_prompts = (lambda *a: 0) if label == "off-nowave" else MIXED
    settings = load_yaml(str(SEED_CONFIG))
    if label in ("off", "off-nowave"):
        settings.pop("speculative_config", None)
    L = max(len(p) for p in prompts)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_build = time.perf_counter()
    llm = LLM(preset, device=device, dtype="bf16" if cuda else "fp32", max_batch_size=64, max_num_tokens=8192, max_seq_len=L + gen + 8,
              **settings)
    eng = llm.engine
    t_build = time.perf_counter() - t_build
    free = torch.cuda.mem_get_info()[0] / 2 ** 30 if cuda else 0.0
    reqs = [DatasetRequest(task_id=i, output_tokens=gen, line=i + 1, input_ids=p) for i, p in enumerate(prompts)]
    _drive(eng, reqs[:2], None, concurrency, prefix="__warm_")  # dsv4-bench's --warmup 2
    if label == "mtp-far" and eng.pause is not None:
        eng.pause.probe_interval = eng.pause.max_probe_every = 10 ** 6
        eng.pause.pause_now(since_probe=3)
    elif label == "mtp-drafting" and eng.pause is not None:
        eng.pause.reset()
    sp = SamplingParams(max_tokens=gen, ignore_eos=True, detokenize=False)
    pause = eng.pause.as_dict() if eng.pause is not None else None
    sync()
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    calls = []
    compiled_before = len(COMPILES.compiles)
    t_run = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, with_stack=stack) as prof:
        with record_function("run"):
            for p in prompts[:concurrency]:
                eng.add_request(p, sp)
            for i in range(steps):
                with record_function(f"step{i + 1}"):
                    m0 = alloc_counts(cuda)
                    t0 = time.perf_counter()
                    outs = eng.step()
                    calls.append(((time.perf_counter() - t0) * 1e3, dict(eng.last_step),
                                  sum(len(o.outputs[0].token_ids) > 0 for o in outs),
                                  [b - a for a, b in zip(m0, alloc_counts(cuda))]))
        sync()
    compiled = COMPILES.since(compiled_before)
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    del llm, eng, prof
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    t0 = min(e["ts"] for e in ev if e["name"] == "run")
    ranges = sorted((e["ts"] - t0, e["ts"] + e["dur"] - t0, e["name"]) for e in ev
                    if e.get("cat") == "user_annotation" and e["name"].startswith("step"))
    gpu = busy([(e["ts"] - t0, e["ts"] + e["dur"] - t0) for e in ev
                if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")])
    # (any runtime or driver call that long: synchronisations and blocking copies, allocations, a kernel launch
    # that loads its module first)
    blocking = sorted((e["ts"] - t0, e["dur"], e["name"]) for e in ev
                      if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] >= min_ms * 1e3)
    print(f"\n### {label} (pause at the start: {pause}; CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING')};"
          f" LLM built and warmed up in {t_build:.1f} s, {free:.1f} GiB free after)\n")
    print("| step | host ms | rows (seqs/tokens/context) | requests with tokens read | GPU busy ms in the call |"
          " from ms | to ms | allocator: cudaMalloc / cudaFree / retries / syncs |")
    print("|---|---|---|---|---|---|---|---|")
    for (s, e, name), (ms, last, n_out, allocs) in zip(ranges, calls):
        b = sum(max(0.0, min(e, be) - max(s, bs)) for bs, be in gpu)
        print(f"| {name} | {ms:.1f} | {last.get('num_seqs')}/{last.get('num_tokens')}/{last.get('num_context')} |"
              f" {n_out} | {b / 1e3:.1f} | {s / 1e3:.1f} | {e / 1e3:.1f} | {' / '.join(map(str, allocs))} |")
    end = ranges[-1][1] if ranges else 0
    gaps = [(a[1], b[0]) for a, b in zip(gpu, gpu[1:]) if b[0] - a[1] >= min_ms * 1e3 and a[1] < end]
    print(f"\nGPU idle gaps >= {min_ms} ms (from, length ms): "
          + ", ".join(f"{s / 1e3:.1f} +{(e - s) / 1e3:.1f}" for s, e in gaps[:20]))
    print("Triton kernels compiled in these steps (at ms, ms, kernel): "
          + (", ".join(f"{(c.at - t_run) * 1e3:.1f} {c.ms:.1f} {c.kernel}" for c in compiled) or "none"))
    print(f"Host calls that blocked >= {min_ms} ms (at ms, ms, call): "
          + ", ".join(f"{s / 1e3:.1f} {d / 1e3:.1f} {n}" for s, d, n in blocking[:30] if s < end))
    # where each call's host time went: the events of the thread that ran the steps, by self time
    main_tid = next(e.get("tid") for e in ev if e["name"] == "step1" and e.get("cat") == "user_annotation")
    host = [e for e in ev if e.get("tid") == main_tid and e.get("cat") in ("cpu_op", "python_function",
                                                                           "cuda_runtime", "cuda_driver")]
    own = self_times(host)
    for s, e, name in ranges:
        by_name: dict[str, float] = {}
        for at, t, n in own:
            if s <= at - t0 < e:
                by_name[n] = by_name.get(n, 0.0) + t
        top = sorted(((t, n) for n, t in by_name.items() if t >= min_ms * 1e3), reverse=True)[:8]
        print(f"- {name} host self time by function, >= {min_ms} ms in the call: "
              + ("; ".join(f"{t / 1e3:.1f} {n[:90]}" for t, n in top) or "none"))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", nargs="+", default=["off", "mtp", "off", "mtp"], choices=("off", "mtp", "mtp-all-rows", "mtp-unpadded", "mtp-far", "mtp-drafting", "mtp-full-keep", "off-nowave"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--min-ms", type=float, default=0.5)
    ap.add_argument("--stack", action="store_true", help="record Python frames (host self time by function)")
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = get_preset(args.preset).vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(args.input)] for _ in range(args.concurrency)]
    for label in args.runs:
        run(label, prompts, args.gen, args.concurrency, args.preset, args.steps, args.min_ms, args.device, args.stack)


if __name__ == "__main__":
    main()
