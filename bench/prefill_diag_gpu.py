"""Diagnosis (one device call): the teacher-forced scenario of test_bf16_teacher_forced_logits_match_dense_reference
in fp32 and bf16, with the indexer's kernels and with its torch twins, and on the plain-torch attention path:
relative logit error per step against the dense reference."""
import random
import sys

import torch

from dsv4 import LLM
from dsv4.cache.manager import SeqStep
from dsv4.engine import cuda_backend
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import ScheduledSeq
from dsv4.kernels.indexer import index_scores_torch, topk_rows_torch


def run(dtype, backend="auto"):
    llm = LLM("tiny", device="cuda", dtype=dtype, max_batch_size=4, max_num_tokens=128, max_seq_len=256,
              kv_cache_config={"max_tokens": 4096}, cuda_graph_config={"enable_padding": True, "batch_sizes": [2]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2}, attention_backend=backend)
    eng, rng = llm.engine, random.Random(3)
    toks = [rng.randrange(2, 256) for _ in range(80)]
    with torch.no_grad():
        dense = llm.model(torch.tensor([toks], device="cuda"))[0].float()
    req = Request("tf", toks[:40], SamplingParams())
    eng.cache.admit("tf")
    pos, errs = 0, []

    def step(n, drafts, accept):
        nonlocal pos
        seq = ScheduledSeq(req, tuple(toks[pos:pos + n]), True, tuple(toks[pos + n - len(drafts):pos + n]))
        eng.cache.reserve("tf", pos + n)
        plan = eng.cache.begin_step([SeqStep("tf", n, 0)], device="cuda", **eng.runner.padding_for([seq]))
        out = eng.runner.forward([seq], plan).logits[0].float()
        ref = dense[pos + n - 1 - len(drafts):pos + n]
        errs.append(round(((out - ref).norm() / ref.norm()).item(), 5))
        eng.cache.commit_step(plan, [accept])
        pos += accept

    step(30, (), 30); step(10, (), 10); step(1, (), 1); step(3, (1, 2), 3); step(3, (1, 2), 1); step(3, (1, 2), 2)
    eng.cache.free("tf")
    return errs


real = cuda_backend.select_top_rows
for dtype in ("fp32", "bf16"):
    print(dtype, "kernels", run(dtype), flush=True)
    cuda_backend.select_top_rows = lambda q, w, keys, rows, valid, k: topk_rows_torch(
        index_scores_torch(q, w, keys, rows, valid), rows, k)
    print(dtype, "indexer twin", run(dtype), flush=True)
    cuda_backend.select_top_rows = real
    print(dtype, "torch attention", run(dtype, "torch"), flush=True)
