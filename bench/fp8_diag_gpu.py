"""Where FP8 linears take the dequantising twin instead of the kernel in a decode step (flash-L4-E32, bf16): the
shapes of every fallback call at batch 1 and 32 (eager steps), and the step's top CUDA kernels at batch 32."""

from __future__ import annotations

import collections
import random

import torch

from dsv4 import LLM, SamplingParams
from dsv4.kernels import fp8_linear as f8

calls = collections.Counter()
for name in ("fp8_linear", "grouped_fp8_linear"):
    orig = getattr(f8, name)

    def wrapped(x, w, s, _orig=orig, _name=name):
        if not f8.usable(x, w, x.shape[0] if _name.startswith("grouped") else x.numel() // x.shape[-1]):
            calls[(_name, tuple(x.shape), tuple(x.stride()), tuple(w.shape), w.is_contiguous(), str(x.dtype))] += 1
        return _orig(x, w, s)
    setattr(f8, name, wrapped)
import dsv4.model.rows as rows  # noqa: E402

rows.fp8_linear, rows.grouped_fp8_linear = f8.fp8_linear, f8.grouped_fp8_linear
llm = LLM("flash-L4-E32", device="cuda", dtype="bf16", max_batch_size=32, max_num_tokens=8192, max_seq_len=300,
          kv_cache_config={"free_gpu_memory_fraction": 0.2}, linear_format="fp8", enforce_eager=True)
eng = llm.engine
rng = random.Random(0)
for B in (1, 32):
    for _ in range(B):
        eng.add_request([rng.randrange(2, 1000) for _ in range(128)], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()
    calls.clear()
    eng.step()
    print("batch", B, "fallback calls:", dict(calls) or "none", flush=True)
    if B == 32:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            eng.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    while eng.has_unfinished_requests():
        eng.step()
