"""The CUDA-graph path's bucketing, padding and static buffers, run eagerly on the CPU (capture is the only
part left to the GPU tests): padded batches through static tables give the same tokens as the torch path."""

import random

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine import cuda_backend
from dsv4.engine.resolved import default_buckets


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
    # the decode-like CudaBackend on the CPU (its kernel falls back to the torch twin off the GPU)
    monkeypatch.setattr(cuda_backend.CudaBackend, "supports", staticmethod(lambda storage: True))


@pytest.mark.parametrize("k, kv", [(0, "auto"), (2, "auto"), (2, "fp8")])
def test_static_bucket_path_equals_torch_path(kernel_path_on_cpu, k, kv, monkeypatch):
    """FP8 too: the kernel path reads the e4m3 rows and their scales where they lie (its twin dequantises them
    as the cache's reads do)."""
    selections = []  # the indexer's compacted top-k rows (tiny: index_topk 3) are what attention reads
    select = cuda_backend.select_top_rows
    monkeypatch.setattr(cuda_backend, "select_top_rows", lambda *a, **kw: selections.append(a[-1]) or select(*a, **kw))
    rng = random.Random(k)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 130, 3)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(max_batch_size=8, max_num_tokens=96, max_seq_len=256, kv_cache_config={"max_tokens": 4096, "dtype": kv},
              warmup=False, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
    ref = [o.outputs[0].token_ids for o in LLM("tiny", attention_backend="torch", **kw).generate(prompts, sp)]
    llm = LLM("tiny", cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 8]}, **kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and not graphs.capture
    replayed, target, step = [], graphs.target, graphs.step
    graphs.target = lambda plan, ids: (replayed.append(plan), target(plan, ids))[1]
    graphs.step = lambda plan, ids: (replayed.append(plan), step(plan, ids))[1]  # (MTP: the whole-step graph)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert out == ref
    assert graphs.num_replays > 0  # 5 decoding requests padded to the 8 bucket
    assert (graphs.num_whole_steps > 0) == (k > 0)
    assert selections and set(selections) == {3}
    # the graph expands its own copy of the per-row vector: no graphed step built its plan's tables
    assert replayed and not any("tables" in vars(p) for p in replayed)


def test_without_padding_only_exact_buckets_replay(kernel_path_on_cpu):
    llm = LLM("tiny", max_batch_size=8, max_num_tokens=96, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              warmup=False, cuda_graph_config={"enable_padding": False, "batch_sizes": [2]})
    g = llm.engine.runner.graphs
    assert g.bucket_for(2, [1, 1]) == 2 and g.bucket_for(3, [1, 1, 1]) is None and g.bucket_for(1, [1]) is None
    assert g.bucket_for(2, [1, 5]) is None  # a prefill chunk in the step: eager


def test_enforce_eager_turns_graphs_off(kernel_path_on_cpu):
    llm = LLM("tiny", max_batch_size=4, max_seq_len=128, kv_cache_config={"max_tokens": 2048}, warmup=False,
              enforce_eager=True)
    assert llm.engine.runner.graphs is None


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_mtp_graphs_refuse_another_steps_tables_or_a_call_out_of_order(kernel_path_on_cpu):
    """The MTP graphs read what the same step's target graph left in the bucket: called for another step's plan,
    or before the graph they follow, they refuse instead of writing that step's MTP rows elsewhere."""
    from dsv4.engine.graphs import GraphOrderError

    llm = LLM("tiny", max_batch_size=4, max_num_tokens=96, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              warmup=False, cuda_graph_config={"enable_padding": True, "batch_sizes": [2, 4]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 3})
    g = llm.engine.runner.graphs
    g.whole_step = False  # (the separate graphs: their order is what is checked)
    plans, target = [], g.target
    g.target = lambda plan, ids: (plans.append(plan), target(plan, ids))[1]
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=10, ignore_eos=True))
    old, last = plans[0], plans[-1]
    assert old is not last and old.shape.batch == last.shape.batch  # two steps on one bucket
    B, N = last.shape.batch, last.shape.tokens
    ids, one = torch.zeros(N, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    X = torch.zeros(B, llm.model_config.hc_mult, llm.model_config.hidden_size)
    with pytest.raises(GraphOrderError, match="another step"):
        g.mtp(old, ids)  # the bucket holds the last step's tables
    target(old, ids)  # a new step on the bucket: target first ...
    with pytest.raises(GraphOrderError, match="runs after mtp"):
        g.draft(old, 2, one, one, X)  # ... then mtp, not draft 2
    g.mtp(old, ids)
    with pytest.raises(GraphOrderError, match="runs after draft2"):
        g.draft(old, 3, one, one)
    g.draft(old, 2, one, one, X)
    g.draft(old, 3, one, one)
    with pytest.raises(GraphOrderError, match="runs after draft2"):
        g.draft(old, 3, one, one)  # not twice


def test_whole_step_graph_refuses_a_bucket_without_it_and_is_not_followed_by_mtp(kernel_path_on_cpu):
    """After a whole-step replay the bucket's separate MTP graphs refuse to follow (their tables are the target
    graph's); a plan with no whole-step graph is refused by name."""
    from dsv4.engine.graphs import GraphOrderError

    llm = LLM("tiny", max_batch_size=2, max_num_tokens=96, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              warmup=False, cuda_graph_config={"enable_padding": True, "batch_sizes": [2]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    g = llm.engine.runner.graphs
    plans, step = [], g.step
    g.step = lambda plan, ids: (plans.append(plan), step(plan, ids))[1]
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert plans and g.num_whole_steps == len(plans)
    last = plans[-1]
    ids = torch.zeros(last.shape.tokens, dtype=torch.long)
    with pytest.raises(GraphOrderError, match="runs after target"):
        g.mtp(last, ids)
    g.whole_step = False
    with pytest.raises(GraphOrderError, match="no whole-step graph"):
        step(last, ids)


@pytest.mark.parametrize("kv, k", [("auto", 0), ("fp8", 2)])
def test_prefill_chunks_on_the_kernel_backend_equal_the_torch_path(kernel_path_on_cpu, kv, k, monkeypatch):
    """Prefill chunks many times longer than the ring's room (tiny: a window of 8) on the kernel backend
    (``PrefillCudaBackend``: the window read from the ring's copy with the chunk's rows appended, the entries,
    indexer and attention as in decode; the kernels' torch twins on the CPU) give the torch path's tokens, with
    an FP8 cache and with MTP's catch-up passes over the chunks too."""
    chunks = []
    real = cuda_backend.PrefillCudaBackend.window
    monkeypatch.setattr(cuda_backend.PrefillCudaBackend, "window",
                        lambda self, l, x: chunks.append(x.shape[0]) or real(self, l, x))
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (200, 77, 5, 130)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=256, kv_cache_config={"max_tokens": 4096, "dtype": kv},
              warmup=False, enforce_eager=True,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
    ref = [o.outputs[0].token_ids for o in LLM("tiny", attention_backend="torch", **kw).generate(prompts, sp)]
    assert not chunks
    out = [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(prompts, sp)]
    assert out == ref
    assert max(chunks) == 64  # whole chunks went through it (window 8: the ring holds 8 + k rows per request)


@pytest.mark.parametrize("k, kv, batch", [(0, "auto", 1), (2, "auto", 1), (2, "fp8", 1), (1, "auto", 3)])
def test_prefill_graphs_equal_the_torch_path(kernel_path_on_cpu, k, kv, batch):
    """One request's prefill chunk replays the prefill bucket of the next token count up (``prefill_token_sizes``,
    padded with inert rows; its window from the ring's copy with the chunk appended), the MTP catch-up and draft
    passes of that step too, on the static buffers; the tokens are the torch path's, the cache intact after every
    step. Prompts longer than max_num_tokens replay for their last chunk only; with several requests in flight
    (batch 3) their prefills share steps with decodes and run eagerly, and the first request's alone replays."""
    rng = random.Random(k + batch)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (1, 9, 40, 70, 96, 130, 200)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(max_batch_size=batch, max_num_tokens=96, max_seq_len=256, warmup=False,
              kv_cache_config={"max_tokens": 4096, "dtype": kv},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
    ref = [o.outputs[0].token_ids for o in LLM("tiny", attention_backend="torch", **kw).generate(prompts, sp)]
    llm = LLM("tiny", cuda_graph_config={"enable_padding": True, "prefill_token_sizes": [16, 64, 96, 2048]}, **kw)
    g = llm.engine.runner.graphs
    assert g.prefill_tokens == [16, 64, 96]  # (above max_num_tokens: dropped)
    chunks = []
    target = g.target
    g.target = lambda plan, ids: (chunks.append((plan.num_new, plan.shape.tokens)), target(plan, ids))[1]
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
        eng.cache.check_integrity()
    assert [eng.requests[r].output_ids for r in rids] == ref
    prefills = [c for c in chunks if c[1] > batch * (1 + k)]
    assert g.num_prefill_replays == len(prefills) > 0
    assert all(len(n) == 1 and n[0] <= T and (T == 16 or n[0] > T // 2 or T == 96) for n, T in prefills)
    if batch == 1:  # every prompt's (last) chunk: 9 -> 16, 40 -> 64, 70 -> 96, 96, 130 = 96 + 34 -> 64, ...
        assert sorted(n[0] for n, _ in prefills) == sorted([9, 40, 70, 96, 96, 34, 96, 96, 8])


def test_prefill_graph_buckets(kernel_path_on_cpu):
    llm = LLM("tiny", max_batch_size=2, max_num_tokens=96, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              warmup=False, cuda_graph_config={"prefill_token_sizes": [16, 64]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    g = llm.engine.runner.graphs
    assert g.prefill_bucket_for(1, [4]) == 16 and g.prefill_bucket_for(1, [64]) == 64
    assert g.prefill_bucket_for(1, [3]) is None  # a verify step's rows: the decode bucket
    assert g.prefill_bucket_for(1, [65]) is None and g.prefill_bucket_for(2, [9, 9]) is None
    default = LLM("tiny", max_batch_size=2, max_num_tokens=300, max_seq_len=256, warmup=False,
                  kv_cache_config={"max_tokens": 4096}).engine.runner.graphs
    assert default.prefill_tokens == [64, 128, 256]
    none = LLM("tiny", max_batch_size=2, max_num_tokens=300, max_seq_len=256, warmup=False,
               kv_cache_config={"max_tokens": 4096}, cuda_graph_config={"prefill_token_sizes": []}).engine.runner.graphs
    assert none.prefill_tokens == [] and none.prefill_bucket_for(1, [40]) is None


@pytest.mark.parametrize("k", [0, 1, 3])
def test_state_rows_written_first_are_never_pooled_in_the_same_step(kernel_path_on_cpu, k, monkeypatch):
    """The decode-like backend stores a step's compressor rows into the state ring before the closing windows
    are pooled (``CudaBackend.state_destination``): no ring row a window of the step pools is one the step
    wrote, whatever the draft length; and the tokens equal the torch path's (which pools, then writes)."""
    checked = []
    real = cuda_backend.CudaBackend.state_destination

    def spy(self, layer_id, name, ratio):
        dest = real(self, layer_id, name, ratio)
        if dest is not None:
            state, rows = dest
            t = self.ratio_tables[ratio]
            pooled = t.win_rows[t.win_valid & (t.win_rows < state.shape[0])]  # ring rows (not the step's own)
            written = rows[rows >= self.storage.layout.state_cap(ratio)]  # past the null slot's rows
            assert not set(pooled.tolist()) & set(written.tolist()), (layer_id, name, ratio)
            checked.append(int(t.win_valid.any()))
        return dest

    monkeypatch.setattr(cuda_backend.CudaBackend, "state_destination", spy)
    rng = random.Random(k)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (3, 17, 64, 150)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    kw = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              warmup=False, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
    ref = [o.outputs[0].token_ids for o in LLM("tiny", attention_backend="torch", **kw).generate(prompts, sp)]
    assert [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(prompts, sp)] == ref
    assert sum(checked) > 10  # steps that closed windows


def test_captures_run_with_the_collector_paused_and_restore_it():
    """``graphs._collector_paused``: the cyclic collector is off inside (a collection during a capture could free
    an earlier engine's graph pools) and back as it was after, an exception included; left off if it was off."""
    import gc

    from dsv4.engine.graphs import _collector_paused

    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_side_stream_only_inside_a_capture():
    """``kernels.side_stream``: no side stream off a CUDA capture (a CPU tensor, or the flag off), so eager steps
    and the CPU keep everything on the current stream; join(None) waits for nothing."""
    from dsv4.kernels.side_stream import join, side_stream

    x = torch.zeros(2)
    assert side_stream(x, True) is None and side_stream(x, False) is None
    join(None, x.device)
