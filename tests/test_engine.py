"""The engine on CPU: against transformers' greedy generate, MTP on == MTP off, preemption, warmup."""

import random
import pytest

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.io import write_checkpoint
from dsv4.config import get_preset
from dsv4.engine.proposer import rewrite_drafts

from .drafters import oracle
from .hf_oracle import hf_greedy, hf_model

MTP = lambda k: {"decoding_type": "MTP", "num_nextn_predict_layers": k}  # noqa: E731


def _checkpoint(tmp_path_factory, preset, seed):
    """A random checkpoint (shared-expert clamp as transformers does, so it can be compared)."""
    cfg = get_preset(preset).replace(shared_expert_clamp=True)
    sd = random_state_dict(cfg, seed=seed)
    d = str(tmp_path_factory.mktemp(preset))
    write_checkpoint(d, cfg, sd)
    return d, cfg, sd


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny", 11)


@pytest.fixture(scope="module")
def tiny_dir(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny-r128", 12)


def _llm(model, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_num_tokens", 96)
    kw.setdefault("max_seq_len", 512)
    kw.setdefault("kv_cache_config", {"max_tokens": 8192})
    return LLM(model, **kw)


def _prompts(n, lens, vocab=256, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(L)] for L in lens[:n]]


@pytest.mark.parametrize("which", ["tiny", "tiny128"])
def test_greedy_equals_transformers_generate(which, request):
    model_dir, cfg, sd = request.getfixturevalue(which)
    lens = [1, 7, 64, 133, 300] if which == "tiny" else [1, 40, 129, 300]
    prompts = _prompts(len(lens), lens)
    llm = _llm(model_dir, max_num_tokens=96)  # 96-token budget: the long prompts prefill in several chunks
    out = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    ours = [o.outputs[0].token_ids for o in out]
    assert ours == hf_greedy(hf_model(cfg, sd), prompts, 8)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_is_token_identical(tiny_dir, k):
    prompts = _prompts(6, [3, 17, 40, 1, 90, 130], seed=k)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    base = _llm(tiny_dir, warmup=False).generate(prompts, sp)
    ref = [o.outputs[0].token_ids for o in base]
    llm = _llm(tiny_dir, speculative_config=MTP(k))
    rewrite_drafts(llm.engine, oracle({tuple(p): r for p, r in zip(prompts, ref)}, 0.6, seed=k))
    out = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == ref
    st = llm.get_stats()["speculative"]
    # both branches ran: some drafts accepted, some rejected, at every position
    assert 0 < st["acceptance_rate"] < 1
    assert len(st["per_position_acceptance"]) == k
    assert st["mean_accepted_len"] > 1


def test_mtp_without_override_still_identical(tiny_dir):
    """The real MTP drafts (near-zero acceptance on random weights) must not change greedy output."""
    prompts = _prompts(3, [5, 33, 70], seed=7)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _llm(tiny_dir, warmup=False).generate(prompts, sp)]
    out = _llm(tiny_dir, speculative_config=MTP(2), warmup=False).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == ref


def test_preemption_gives_the_same_tokens(tiny_dir):
    prompts = _prompts(6, [40, 60, 80, 30, 100, 50], seed=3)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _llm(tiny_dir, warmup=False).generate(prompts, sp)]
    # room for only ~2 of the 6 sequences' growing state at a time
    small = _llm(tiny_dir, kv_cache_config={"max_tokens": 384, "tokens_per_block": 16}, max_seq_len=160,
                 speculative_config=MTP(2), warmup=False)
    out = small.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert small.get_stats()["num_preemptions"] > 0
    assert small.engine.cache.num_free_blocks == small.engine.cache.num_blocks


def test_chunked_prefill_equals_one_shot(tiny_dir):
    prompts = _prompts(3, [200, 150, 90], seed=4)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    one = _llm(tiny_dir, max_num_tokens=512, warmup=False).generate(prompts, sp)
    chunked = _llm(tiny_dir, max_num_tokens=13, warmup=False).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in chunked]


def _kernel_path_steps(monkeypatch) -> list:
    """The kernel path's torch twins on the CPU, and every step's (rows, C) of each request as begin_step sees them
    (the list returned fills as steps begin)."""
    from dsv4.cache.manager import KVCacheManager

    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    steps, begin = [], KVCacheManager.begin_step

    def recorded(self, seqs, **kw):
        steps.append([(s.num_new, self._reqs[s.req_id].num_computed) for s in seqs])
        return begin(self, seqs, **kw)
    monkeypatch.setattr(KVCacheManager, "begin_step", recorded)
    return steps


def test_warmup_runs_a_full_step_of_prompts_beside_decode_rows(tiny_dir, monkeypatch):
    """Warmup's path of a server's first wave: a step of max_num_tokens that holds decode rows, a chunk that
    continues a prompt an earlier step began, and new prompts (the single context chunk has none of these). On
    the kernel path (here its torch twins on the CPU)."""
    steps = _kernel_path_steps(monkeypatch)
    llm = LLM(tiny_dir, max_batch_size=8, max_num_tokens=100, max_seq_len=256)
    assert "prompts in chunks of max_num_tokens beside decode rows (3 x 100 tokens)" in llm.warmup_paths
    assert any(sum(n for n, _ in st) == 100 and any(c >= 100 for _, c in st)  # decode rows
               and any(0 < c < 100 for _, c in st) and any(n > 1 and c == 0 for n, c in st) for st in steps)


def test_warmup_runs_the_largest_step_of_prompts_a_short_max_seq_len_allows(tiny_dir, monkeypatch):
    """Where too few prompts fit to fill two steps of max_num_tokens (a short max_seq_len: bench/decode_floor.py's
    32 x 128-token prompts), warmup runs as many prompts as fit in one step: the largest prompt step the
    configuration allows (its kernels' tiles may follow a step's rows). On the kernel path (its torch twins on
    the CPU); not where the context chunk is already that large."""
    steps = _kernel_path_steps(monkeypatch)
    llm = LLM(tiny_dir, max_batch_size=4, max_num_tokens=400, max_seq_len=80,
              kv_cache_config={"max_tokens": 4096, "tokens_per_block": 16})
    path = [p for p in llm.warmup_paths if p.startswith("prompts in")]
    assert len(path) == 1 and path[0].startswith("prompts in one step (") and path[0].endswith(" x 72 tokens)")
    n = int(path[0].split("(")[1].split(" x ")[0])  # (as many as the batch and the cache hold: 3 of 4 here)
    assert n >= 3 and any(sorted(st) == [(72, 0)] * n for st in steps)  # n new prompts in one step
    one = LLM(tiny_dir, max_batch_size=1, max_num_tokens=400, max_seq_len=80,  # (one prompt: the chunk's size)
              kv_cache_config={"max_tokens": 4096, "tokens_per_block": 16})
    assert not any(p.startswith("prompts in") for p in one.warmup_paths)


@pytest.mark.parametrize("mtp", [None, MTP(1)])
def test_warmup_with_the_seeds_settings(tiny_dir, mtp):
    llm = LLM(tiny_dir, max_batch_size=4, max_num_tokens=256, max_seq_len=512,
              kv_cache_config={"tokens_per_block": 128, "dtype": "fp8", "free_gpu_memory_fraction": 0.9},
              cuda_graph_config={"enable_padding": True}, moe_config={"backend": "TRTLLM"},
              speculative_config=mtp)
    # (MTP: verify + draft, drafting paused thrice, the kept-rows passes at every row count; on the CPU no full
    # steps of prompts beside decode rows)
    assert len(llm.warmup_paths) == (7 if mtp else 2)
    cache = llm.engine.cache
    assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == cache.num_slots
    prompts = _prompts(3, [3, 40, 130], seed=5)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    cold = LLM(tiny_dir, max_batch_size=4, max_num_tokens=256, max_seq_len=512, warmup=False,
               kv_cache_config={"tokens_per_block": 128, "dtype": "fp8"}, speculative_config=mtp)
    assert out == [o.outputs[0].token_ids for o in cold.generate(prompts, sp)]  # warmup left nothing behind


def test_warmup_names_an_unprepared_table(tiny_dir, monkeypatch):
    """If a step plan lacked a table the model needs, warmup fails naming the path and the table."""
    from dsv4.engine import backend as be
    from dsv4.engine.warmup import WarmupError

    real = be.CachedBackend.for_step.__func__

    def without_ratio_tables(cls, plan, storage):
        b = real(cls, plan, storage)
        b.ratio_tables = {}
        return b

    monkeypatch.setattr(be.CachedBackend, "for_step", classmethod(without_ratio_tables))
    with pytest.raises(WarmupError, match=r"context chunk.*ratio-4 tables"):
        _llm(tiny_dir)


def test_bad_requests_get_clear_errors(tiny_dir):
    llm = _llm(tiny_dir, warmup=False, max_seq_len=64)
    outs = llm.generate([[1, 2, 3], [5] * 70, [300]], SamplingParams(max_tokens=4))
    assert len(outs[0].outputs[0].token_ids) == 4 and outs[0].error is None
    assert "max_seq_len" in outs[1].error
    assert "vocabulary" in outs[2].error


def test_mtp_on_a_checkpoint_without_mtp_is_refused(tmp_path):
    from dsv4.engine.config import EngineConfigError

    cfg = get_preset("tiny")
    sd = {k: v for k, v in random_state_dict(cfg, seed=1).items() if not k.startswith("mtp.")}
    write_checkpoint(str(tmp_path), cfg, sd)
    with pytest.raises(EngineConfigError, match="MTP"):
        _llm(str(tmp_path), speculative_config=MTP(1))


def test_streaming_yields_growing_outputs(tiny_dir):
    llm = _llm(tiny_dir, warmup=False)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    seen = [list(o.outputs[0].token_ids) for o in llm.generate_stream([[4, 5, 6]], sp)]
    final = llm.generate([[4, 5, 6]], sp)[0].outputs[0].token_ids
    assert seen == [final[:i] for i in range(1, 6)]  # each yield extends the last by the next token
    assert not llm.engine.requests  # finished requests do not pile up in a long-running stream


def test_abort_frees_everything_and_others_finish(tiny_dir):
    llm = _llm(tiny_dir, warmup=False, speculative_config=MTP(2))
    eng = llm.engine
    a = eng.add_request([5, 6, 7] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    b = eng.add_request([9, 8] * 10, SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.abort_request(a)
    while eng.has_unfinished_requests():
        eng.step()
    solo = _llm(tiny_dir, warmup=False, speculative_config=MTP(2)).generate([[9, 8] * 10],
                                                                             SamplingParams(max_tokens=10, ignore_eos=True))
    assert eng.requests[b].output_ids == solo[0].outputs[0].token_ids  # the abort did not touch b's tokens
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and eng.cache.num_free_slots == eng.cache.num_slots
    eng.cache.check_integrity()


def test_request_token_views_equal_the_full_sequence():
    """token_at / token_range (what the per-step paths use instead of building prompt + outputs each step)."""
    from dsv4.engine.request import Request

    rng = random.Random(0)
    for _ in range(200):
        r = Request("x", [rng.randrange(9) for _ in range(rng.randrange(1, 10))], SamplingParams(max_tokens=50))
        r.output_ids = [rng.randrange(9) for _ in range(rng.randrange(0, 10))]
        full = r.tokens
        assert [r.token_at(p) for p in range(len(full))] == full
        assert all(r.token_range(a, b) == tuple(full[a:b]) for a in range(len(full) + 1)
                   for b in range(a, len(full) + 1))


def test_detokenize_false_gives_ids_only(tiny_dir, tmp_path):
    import shutil

    from dsv4.checkpoint.tokenizer import write_byte_tokenizer

    d = tmp_path / "tok"
    shutil.copytree(tiny_dir, d)
    write_byte_tokenizer(str(d), 256)
    llm = _llm(str(d), warmup=False)
    with_text, ids_only = llm.generate([[4, 5, 6], [4, 5, 6]], [SamplingParams(max_tokens=4),
                                                                SamplingParams(max_tokens=4, detokenize=False)])
    assert with_text.outputs[0].token_ids == ids_only.outputs[0].token_ids
    assert with_text.outputs[0].text == llm.tokenizer.decode(with_text.outputs[0].token_ids)
    assert ids_only.outputs[0].text is None


def test_token_ids_of_any_integer_type_equal_plain_ints():
    """The prompt check's fast test takes plain ints; other integers (numpy's) go through the general one and
    give the same tokens; a bool among them is still refused."""
    import numpy as np

    llm = LLM("tiny", warmup=False)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = [5, 17, 3, 99, 42]
    plain = llm.generate([ids], sp)[0].outputs[0].token_ids
    assert llm.generate([[np.int64(t) for t in ids]], sp)[0].outputs[0].token_ids == plain
    with pytest.raises(TypeError, match="prompt 0"):
        llm.generate([[np.int64(5), True]], sp)
