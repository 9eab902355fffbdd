"""The engine on CUDA: against the dense reference (fp32, exact), its fast paths against their plain twins (the
FP8 cache, CUDA graphs with padding, the overlap scheduler, programmatic dependent launch, the shared expert on a
side stream), bf16 logits within bounds. Skipped without CUDA (run on the device machine: `pytest -m cuda`).
The kernels one by one against their torch twins: test_kernel*_cuda.py."""

import random

import pytest
import torch

from .traces import assert_same_steps, run_traced

pytestmark = pytest.mark.cuda


def dense_greedy(model, prompts, n):
    """Greedy continuation by the dense reference path, one full forward per token."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids], device="cuda"))[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


def _engine(model, **kw):
    from dsv4 import LLM

    kw.setdefault("kv_cache_config", {"max_tokens": 8192})
    kw.setdefault("dtype", "fp32")
    return LLM(model, device="cuda", max_batch_size=8, max_num_tokens=128, max_seq_len=512, **kw)


@pytest.mark.parametrize("k", [0, 2])
def test_engine_on_cuda_equals_dense_reference(k):
    """fp32 on the GPU, Triton attention for decode/verify: greedy output equals the dense reference, and
    MTP on equals MTP off (batches of 5 with drafts, decode steps through the kernel)."""
    from dsv4 import SamplingParams

    rng = random.Random(k)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 200)]
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None
    llm = _engine("tiny", speculative_config=spec)
    assert llm.engine.runner.use_kernels
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert out == dense_greedy(llm.model, prompts, 16)


def test_fp8_cache_kernel_path_equals_torch_path():
    """The seed's cache dtype: an FP8 KV cache on the kernel path (CUDA graphs on, MTP 2) gives the greedy tokens
    of the plain-torch attention path over the same FP8 cache (fp32 model)."""
    from dsv4 import SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 3)]
    kw = dict(speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2},
              kv_cache_config={"max_tokens": 8192, "dtype": "fp8"})
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _engine("tiny", attention_backend="torch", **kw).generate(prompts, sp)]
    llm = _engine("tiny", cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 8]}, **kw)
    assert llm.engine.runner.use_kernels and llm.engine.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    assert llm.engine.runner.graphs.num_replays > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_sampled_requests_with_mtp_emit_mtp_off_tokens_on_cuda(overlap):
    """fp32 on the GPU with CUDA graphs: seeded sampled requests (temperature, top-k, top-p) beside greedy ones
    emit MTP off's tokens with MTP k = 2 (their keyed draws: ``sampler.sample_keyed``), overlapped or not."""
    from dsv4 import SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 3, 17)]
    sp = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=t, top_k=k, top_p=p, seed=i)
          for i, (t, k, p) in enumerate([(0.7, 0, 1.0), (1.0, 40, 0.9), (1.3, 0, 0.95), (0.9, 20, 1.0)])]
    sp += [SamplingParams(max_tokens=20, ignore_eos=True)] * 2
    kw = dict(cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 8]},
              disable_overlap_scheduler=not overlap)
    off = [o.outputs[0].token_ids for o in _engine("tiny", **kw).generate(prompts, sp)]
    llm = _engine("tiny", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2}, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == off
    st = llm.get_stats()["speculative"]
    assert st["num_draft_tokens"] > 0 and llm.engine.runner.graphs.num_replays > 0


def _bf16_mtp_outputs():
    """tiny in bf16 (where a race or a reordering would show), FP8 cache, MTP 2, decode graphs with padding and
    prefill graphs, a greedy and a seeded sampled request: each request's tokens and logprobs."""
    from dsv4 import LLM, SamplingParams

    rng = random.Random(11)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 300)]
    sp = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2) for _ in prompts]
    sp[1] = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=40, seed=5, logprobs=2)
    llm = LLM("tiny", device="cuda", dtype="bf16", max_batch_size=8, max_num_tokens=128, max_seq_len=512,
              kv_cache_config={"max_tokens": 8192, "dtype": "fp8"},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2},
              cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 8]})
    out = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp)]
    assert llm.engine.runner.graphs.num_replays > 0
    return out


def test_pdl_launches_give_the_bits_of_plain_launches():
    """Every kernel launched with programmatic dependent launch (the default from Hopper on) computes what plain
    launches compute, in the same order: the same tokens and logprobs, bit for bit (``_bf16_mtp_outputs``).
    Fails if a kernel touched memory before its wait."""
    from dsv4.kernels import pdl

    on = _bf16_mtp_outputs()
    assert pdl.args()["PDL"] == (pdl.WAIT if torch.cuda.get_device_capability()[0] >= 9 else 0)
    pdl.set_enabled(False)
    try:
        assert pdl.args() == {"PDL": 0}
        off = _bf16_mtp_outputs()
    finally:
        pdl.set_enabled(True)
    assert on == off


def test_shared_expert_on_a_side_stream_gives_the_same_bits(monkeypatch):
    """The shared expert captured on a second stream (model.moe.SHARED_OVERLAP), joined before the combine: the
    tokens and logprobs of the same graphs with it on the main stream, bit for bit; the side stream was used.
    Fails if the join came after the combine read its input."""
    from dsv4.model import moe

    _side_stream_gives_the_same_bits(monkeypatch, moe, "SHARED_OVERLAP")


def test_mhc_sinkhorn_on_a_side_stream_gives_the_same_bits(monkeypatch):
    """The mHC Sinkhorn captured on a second stream (model.mhc.MHC_OVERLAP), joined before the write-back: the
    tokens and logprobs of the same graphs with it on the main stream, bit for bit; the side stream was used.
    Fails if the write-back read the comb before the join."""
    from dsv4.model import mhc

    _side_stream_gives_the_same_bits(monkeypatch, mhc, "MHC_OVERLAP")


def _side_stream_gives_the_same_bits(monkeypatch, module, flag: str):
    """``_bf16_mtp_outputs`` with ``module.flag`` on (the module's side_stream handed out a stream) equals it
    with the flag off (it handed out none), the other side-stream users left as they are."""
    seen, real = [], module.side_stream
    monkeypatch.setattr(module, "side_stream", lambda x, enabled: (lambda s: seen.append(s) or s)(real(x, enabled)))
    monkeypatch.setattr(module, flag, True)
    on = _bf16_mtp_outputs()
    assert any(s is not None for s in seen)
    monkeypatch.setattr(module, flag, False)
    seen.clear()
    assert on == _bf16_mtp_outputs() and seen and not any(seen)


@pytest.mark.parametrize("k", [0, 2])
def test_cuda_graphs_padded_buckets_equal_dense_reference(k):
    """fp32, CUDA graphs on with padding: 5 decoding requests replay the 8 bucket; tokens equal the dense
    reference and MTP on equals MTP off."""
    from dsv4 import SamplingParams

    rng = random.Random(10 + k)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 3)]
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None
    llm = _engine("tiny", speculative_config=spec, cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 8]})
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.capture
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert graphs.num_replays > 0
    assert out == dense_greedy(llm.model, prompts, 16)


@pytest.mark.parametrize("overlap", [True, False])
def test_paused_drafting_on_captured_graphs_equals_dense_reference(overlap):
    """fp32, CUDA graphs captured, the keep-up runner's buckets (one row a request: the target pass and the MTP
    catch-up pass without the head, alone or in the paused step's whole-step graph) in the same pool as the verify
    buckets: drafting paused after each rejected
    draft and probed every third step, so steps move between both runners; warmup ran the paused path. Tokens
    equal the dense reference; the keep-up graphs replayed."""
    from dsv4 import SamplingParams
    from dsv4.engine.spec_pause import DraftPause

    rng = random.Random(21)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 3)]
    llm = _engine("tiny", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2},
                  cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 8]},
                  disable_overlap_scheduler=not overlap)
    assert any(n.startswith("MTP with drafting paused") for n in llm.warmup_paths)
    keep = llm.engine.runner.keep_graphs
    assert keep is not None and keep.capture and keep.num_replays > 0  # (warmup)
    n = keep.num_replays
    llm.engine.pause = DraftPause(1.0, window=1, probe_every=3)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert keep.num_replays > n and keep.num_whole_steps > 0 and llm.engine.pause.num_pauses > 0
    assert out == dense_greedy(llm.model, prompts, 16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_keep_up_pass_stores_the_whole_passs_window_rows_on_cuda(dtype, monkeypatch):
    """CUDA graphs captured: the keep-up pass (the MTP layer's window rows only) against the whole MTP pass in
    its place (patched before capture), through chunked prompts, paused steps and probes: every window row of
    every layer after every step bit for bit, and the same tokens and drafts."""
    from dsv4 import SamplingParams
    from dsv4.engine.spec_pause import DraftPause
    from dsv4.model.model import DeepseekV4

    rng = random.Random(22)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (3, 40, 150, 9)]
    runs = []
    for whole_pass in (False, True):
        if whole_pass:
            monkeypatch.setattr(DeepseekV4, "mtp_keep_up",
                                lambda self, X, ids, backend: self.mtp_streams(X, ids, backend))
        llm = _engine("tiny", dtype=dtype, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2},
                      cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]})
        eng = llm.engine
        eng.pause = DraftPause(1.0, window=1, probe_every=3)
        rids = [eng.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True)) for p in prompts]
        runs.append(run_traced(eng, rids, rings=True))
        assert eng.pause.num_paused_steps > 3 and eng.runner.keep_graphs.num_replays > 0
    assert_same_steps(*runs)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_paused_steps_far_from_a_probe_leave_the_mtp_ring_on_cuda(dtype, monkeypatch):
    """CUDA graphs captured: paused steps more than the ring's span before the next probe replay the keep-up
    runner's bare whole-step graph (no keep-up pass; a prompt arriving then, none either; one arriving 5 steps
    before a probe keeps its last rows only), against a run that keeps every row at every paused step: the same
    tokens and steps, and every ring row the cache calls current bit for bit after every step."""
    from dsv4 import SamplingParams
    from dsv4.engine.spec_pause import DraftPause

    from .traces import assert_same_current_rows, ring_spans

    rng = random.Random(23)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (3, 40, 150, 9)]
    runs, bare = [], []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(DraftPause, "keep_rows", lambda self, margin: margin)
        llm = _engine("tiny", dtype=dtype, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2},
                      cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]})
        eng = llm.engine
        n = eng.runner.keep_graphs.num_bare_steps  # (warmup's)
        eng.pause = DraftPause(1.0, window=1, probe_every=eng.cache.layout.swa_cap + 6)
        rids = [eng.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in prompts]
        trace, near = [], False
        while eng.has_unfinished_requests():
            if len(trace) == 12:  # far from the next probe
                rids.append(eng.add_request(prompts[2][::-1], SamplingParams(max_tokens=60, ignore_eos=True)))
            elif not near and len(trace) > 12 and eng.pause.paused and \
                    eng.pause.probe_interval - eng.pause._since_probe == 6:  # near it: keeps its last rows only
                rids.append(eng.add_request(prompts[1][::-1], SamplingParams(max_tokens=30, ignore_eos=True)))
                near = True
            eng.step()
            trace.append(([tuple(eng.requests[r].output_ids) for r in rids]
                          + [(eng.last_step["num_seqs"], eng.last_step["num_tokens"])], ring_spans(eng, rids)))
        runs.append(trace)
        bare.append(eng.runner.keep_graphs.num_bare_steps - n)
    assert bare[0] > 0 and bare[1] == 0
    assert assert_same_current_rows(*runs) > 0


@pytest.mark.parametrize("pause", [False, True])
def test_kept_rows_mtp_pass_equals_every_rows_pass_on_cuda(pause, monkeypatch):
    """CUDA graphs captured, batch-invariant, fp32: the MTP catch-up pass over each request's last swa_cap rows
    (``engine/mtp_rows.py``; eager chunks and prefill graph buckets) against the pass over every row of the step:
    the same tokens and drafts and every window row of every layer bit for bit after every step."""
    from dsv4 import SamplingParams
    from dsv4.engine.runner import ModelRunner
    from dsv4.engine.spec_pause import DraftPause

    rng = random.Random(30)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (3, 40, 150, 9, 300)]
    runs, replays = [], []
    for tail in (True, False):
        monkeypatch.setattr(ModelRunner, "mtp_tail_rows", tail)
        llm = _engine("tiny", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2},
                      batch_invariant=True, cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4],
                                                               "prefill_token_sizes": [16, 64, 128]})
        eng = llm.engine
        if pause:
            eng.pause = DraftPause(1.0, window=1, probe_every=3)
        rids = [eng.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True)) for p in prompts]
        runs.append(run_traced(eng, rids, rings=True))
        replays.append(eng.runner.graphs.num_prefill_replays)
    assert replays[0] > 0
    assert_same_steps(*runs)


def test_overlap_scheduler_equals_sync_on_cuda(monkeypatch):
    """fp32, CUDA graphs on: the overlap scheduler (inputs taken from the device, copies that do not wait)
    gives the tokens and finish reasons of the same engine with it off, with stop tokens that end requests
    while their next step is already launched and a sampled request; and it did overlap."""
    from dsv4 import SamplingParams
    from dsv4.engine import runner as runner_mod

    seen, real = [], runner_mod.pending_inputs
    monkeypatch.setattr(runner_mod, "pending_inputs", lambda seqs, prev: (lambda r: seen.append(len(r[0])) or r)(
        real(seqs, prev)))
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 3)]
    kw = dict(cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 8]})
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (16, 7, 12, 16, 9)]
    ref = [o.outputs[0].token_ids for o in _engine("tiny", disable_overlap_scheduler=True, **kw).generate(prompts, sp)]
    for i in (0, 3):
        sp[i] = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[ref[i][5]])
    # drawn on the device when overlapped; EOS ignored, so the two stop tokens are the only early ends
    sp[2] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=50, seed=3)
    off = _engine("tiny", disable_overlap_scheduler=True, **kw)
    ref = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in off.generate(prompts, sp)]
    seen.clear()
    on = _engine("tiny", **kw)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in on.generate(prompts, sp)] == ref
    assert sum(seen) > 0 and on.engine.runner.graphs.num_replays > 0
    assert [r[1] for r in ref].count("stop") == 2


def test_bf16_teacher_forced_logits_match_dense_reference():
    """bf16 on the GPU: the engine's prefill, decode and verify paths (graphs and padding on) give the
    logits of the bf16 dense reference at the same positions, within bf16 bounds. The kernels sum in another
    order than the dense torch ops, and a rounding difference can flip one discrete choice on a row (an
    indexer top-k pick, then an expert): one of the six steps may then be off by more, never by a wrong
    pass's error (the fp32 tests are exact)."""
    from dsv4 import LLM
    from dsv4.cache.manager import SeqStep
    from dsv4.engine.request import Request
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.engine.scheduler import ScheduledSeq

    llm = LLM("tiny", device="cuda", dtype="bf16", max_batch_size=4, max_num_tokens=128, max_seq_len=256,
              kv_cache_config={"max_tokens": 4096}, cuda_graph_config={"enable_padding": True, "batch_sizes": [2]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    eng, rng = llm.engine, random.Random(3)
    toks = [rng.randrange(2, 256) for _ in range(80)]
    with torch.no_grad():
        dense = llm.model(torch.tensor([toks], device="cuda"))[0].float()  # [T, V]
    req = Request("tf", toks[:40], SamplingParams())
    eng.cache.admit("tf")
    pos, errs, graphed = 0, [], 0

    def step(n, drafts, accept):
        nonlocal pos, graphed
        seq = ScheduledSeq(req, tuple(toks[pos:pos + n]), True, tuple(toks[pos + n - len(drafts):pos + n]))
        eng.cache.reserve("tf", pos + n)
        plan = eng.cache.begin_step([SeqStep("tf", n, 0)], device="cuda", **eng.runner.padding_for([seq]))
        graphed += eng.runner._graphed(plan)
        out = eng.runner.forward([seq], plan).logits[0].float()  # rows pos+n-1-len(drafts) .. pos+n-1
        ref = dense[pos + n - 1 - len(drafts):pos + n]
        errs.append(((out - ref).norm() / ref.norm()).item())
        eng.cache.commit_step(plan, [accept])
        pos += accept

    step(30, (), 30)       # prefill chunk
    step(10, (), 10)       # another chunk
    step(1, (), 1)         # decode
    step(3, (1, 2), 3)     # verify, all accepted
    step(3, (1, 2), 1)     # verify, drafts rejected: rolled back
    step(3, (1, 2), 2)
    eng.cache.free("tf")
    assert graphed >= 3
    assert sorted(errs)[-2] < 3e-2 and max(errs) < 0.5, errs
