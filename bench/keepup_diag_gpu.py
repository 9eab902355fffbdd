"""Where the keep-up pass's window rings differ from the whole MTP pass's on CUDA (tests/test_engine_cuda.py's
keep-up test failed there in the 29th session): per step, per ring, the slots and ring rows that differ."""

import random
import sys


sys.path.insert(0, ".")
from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.engine.spec_pause import DraftPause  # noqa: E402
from dsv4.model.model import DeepseekV4  # noqa: E402

real = DeepseekV4.mtp_keep_up
rng = random.Random(22)
prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (3, 40, 150, 9)]
runs = []
for whole in (False, True):
    DeepseekV4.mtp_keep_up = ((lambda self, X, ids, backend: self.mtp_streams(X, ids, backend)) if whole
                              else real)
    llm = LLM("tiny", device=sys.argv[1] if len(sys.argv) > 1 else "cuda", dtype="fp32", max_batch_size=8,
              max_num_tokens=128, max_seq_len=512,
              kv_cache_config={"max_tokens": 8192},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2},
              cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]})
    eng = llm.engine
    eng.pause = DraftPause(1.0, window=1, probe_every=3)
    rids = [eng.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True)) for p in prompts]
    trace = []
    while eng.has_unfinished_requests():
        eng.step()
        trace.append(([t.clone() for t in eng.storage.swa], eng.pause.paused, dict(eng.last_step)))
    S = eng.cache.layout.swa_cap
    runs.append(trace)
    print("whole" if whole else "keep-up", "steps", len(trace), "swa_cap", S, "rings", len(trace[0][0]),
          [tuple(t.shape) for t in trace[0][0]], flush=True)
S = eng.cache.layout.swa_cap
L = len(runs[0][0][0])
for i, ((ra, pa, la), (rb, pb, lb)) in enumerate(zip(*runs)):
    bad = []
    for l, (x, y) in enumerate(zip(ra, rb)):
        d = (x != y).any(-1).nonzero().flatten().tolist()
        if d:
            bad.append((l, sorted({r // S for r in d}), [r % S for r in d][:8], float((x - y).abs().max())))
    if bad:
        print(f"step {i} paused {pa}/{pb} num_seqs {la.get('num_seqs')} tokens {la.get('num_tokens')}: layers "
              f"{[b[0] for b in bad]} slots {bad[0][1]} rows {bad[0][2]} maxdiff {bad[0][3]:.3g}"
              f" (last layer: slots {bad[-1][1]} rows {bad[-1][2]})", flush=True)
print("ring layers (MTP layer last?)", L)
