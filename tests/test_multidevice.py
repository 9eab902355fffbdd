"""Several ranks on the CPU (2 gloo processes): tensor, expert and attention-data parallelism, MTP included.

The matrix (tp2, ep2, tp2+ep2, attention DP 2 + ep2) x (MTP off, MTP k=2) must give token-identical greedy
output to the single-process engine. Summing partial results across ranks changes fp32 rounding slightly,
so the matrix runs in float64 (greedy argmax is then far from any tie); the MTP cells also compare the MTP
layer's own draft proposals with the single-process ones, so the draft layer's split is checked and not
only verified away. Plus: a rank that raises stops every rank with its message, and clear refusals.
"""

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.io import write_checkpoint
from dsv4.config import get_preset
from dsv4.engine.config import EngineConfig, EngineConfigError
from dsv4.engine.proposer import rewrite_drafts
from dsv4.engine.spec_pause import DraftPause
from dsv4.parallel.comm import RankError
from dsv4.parallel.executor import ForwardMsg, ProposeMsg
from dsv4.parallel.mapping import ParallelMapping
from dsv4.parallel.shard import shard_state_dict

MTP2 = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
MODES = {
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"moe_expert_parallel_size": 2},
    "tp2+ep2": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2},
    "adp2+ep2": {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2, "enable_attention_dp": True},
}
KW = dict(max_batch_size=4, max_num_tokens=48, max_seq_len=256, kv_cache_config={"max_tokens": 2048},
          dtype="fp64")
LENS = [3, 17, 70, 130, 9, 40]  # 70 and 130 prefill in several 48-token chunks
SP8 = SamplingParams(max_tokens=8, ignore_eos=True)




@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = get_preset("tiny")
    d = str(tmp_path_factory.mktemp("tiny_md"))
    write_checkpoint(d, cfg, random_state_dict(cfg, seed=5))
    return d


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(2, 256) for _ in range(n)] for n in LENS]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _oracle(reference, proposals):
    """Draft rewrite (driver-side, a RewrittenProposer): records what the MTP layer proposed, keyed by request and
    position, and replaces it by the known answer 60% of the time so drafts are both accepted and rejected."""
    rng = random.Random(0)

    def override(req, drafts):
        done = len(req.output_ids)
        proposals[(tuple(req.prompt_ids), done)] = list(drafts)
        answer = reference[tuple(req.prompt_ids)]
        out = []
        for j, d in enumerate(drafts):
            truth = answer[done + j] if done + j < len(answer) else d
            out.append(truth if rng.random() < 0.6 else (truth + 1) % 256)
        return out

    return override


@pytest.fixture(scope="module")
def single(ckpt, prompts):
    """The single-process engine's greedy tokens, and its MTP proposals under the oracle override."""
    ref = _tokens(LLM(ckpt, warmup=False, **KW).generate(prompts, SP8))
    llm = LLM(ckpt, warmup=False, speculative_config=MTP2, **KW)
    proposals = {}
    rewrite_drafts(llm.engine, _oracle({tuple(p): r for p, r in zip(prompts, ref)}, proposals))
    assert _tokens(llm.generate(prompts, SP8)) == ref
    return ref, proposals


@pytest.mark.parametrize("mtp", [False, True], ids=["mtp-off", "mtp2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_matrix_token_identical(ckpt, prompts, single, mode, mtp):
    ref, ref_proposals = single
    llm = LLM(ckpt, speculative_config=MTP2 if mtp else None, **KW, **MODES[mode])
    try:
        par = llm.get_stats()["parallel"]
        assert par["world_size"] == 2 and par["attention_dp"] == ("adp" in mode)
        # warmup ran every path on both ranks (with MTP the three paths with drafting paused, and not under
        # attention DP the kept-rows passes too)
        assert len(llm.warmup_paths) == ((6 + ("adp" not in mode)) if mtp else 2)
        cache = llm.engine.cache
        assert cache.num_free_slots == cache.num_slots and cache.num_free_blocks == cache.num_blocks
        proposals = {}
        if mtp:
            rewrite_drafts(llm.engine, _oracle({tuple(p): r for p, r in zip(prompts, ref)}, proposals))
        assert _tokens(llm.generate(prompts, SP8)) == ref
        if mtp:
            st = llm.get_stats()["speculative"]
            assert 0 < st["acceptance_rate"] < 1  # both the accept and the reject path ran on every rank
            common = proposals.keys() & ref_proposals.keys()
            assert len(common) >= len(prompts)
            assert {k: proposals[k] for k in common} == {k: ref_proposals[k] for k in common}
        assert cache.num_free_slots == cache.num_slots
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["tp2", "adp2+ep2"])
def test_overlapped_steps_on_every_rank_equal_one_process(ckpt, prompts, mode):
    """MTP off with the overlap scheduler (the default): each step is announced before the previous step's
    tokens are read back, and those inputs reach every rank by a broadcast from the driver's device. Greedy,
    stop-token and sampled requests give the single process's tokens and finish reasons; the steps did overlap
    (messages with pending ids), and with the scheduler off none has them."""
    sp = [SamplingParams(max_tokens=10, ignore_eos=True) for _ in prompts]
    sp[2] = SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True)
    ref = LLM(ckpt, warmup=False, **KW).generate(prompts, sp)
    for i in (0, 3):  # stop tokens that end requests while their next step is already launched
        sp[i] = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[ref[i].outputs[0].token_ids[4]])
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in LLM(ckpt, warmup=False, **KW).generate(
        prompts, sp)]
    assert [w[1] for w in want].count("stop") == 2
    for overlap in (True, False):
        llm = LLM(ckpt, warmup=False, disable_overlap_scheduler=not overlap, **KW, **MODES[mode])
        try:
            group, sent = llm.engine.runner.group, []
            send = group.send
            group.send = lambda m: (sent.append(m), send(m))[1]
            got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, sp)]
            assert got == want
            pending = [m.pending_ids for m in sent if isinstance(m, ForwardMsg)]
            assert (sum(1 for n in pending if n) >= 5) == overlap, pending
        finally:
            llm.shutdown()


@pytest.mark.parametrize("mode", ["tp2", "tp2+ep2", "adp2+ep2"])
def test_overlapped_mtp_steps_on_every_rank_equal_the_synchronous_ones(ckpt, prompts, single, mode):
    """MTP k=2 with the overlap scheduler on several ranks: a verify step is announced before the previous
    step's acceptance is read back, so the driver broadcasts its plans' C columns (the accepted drafts only its
    device knows), the bonus tokens and drafts, the catch-up inputs from acceptance on its device and every
    draft pass's tokens. Under attention DP acceptance runs on the driver over both lanes' gathered logits and
    inputs, and each lane's run of the catch-up inputs goes to its rank. Drafts are the known answer 70% of the
    time (a device proposer: both accept and reject run). Greedy and stop-token requests give the single
    process's MTP-off tokens and the synchronous run's, with the same acceptance; a sampled request (its draws
    keyed by position, which an overlapped step takes from the device's C) gives the synchronous run's tokens;
    overlapped MTP steps happened (plans with unsettled rows sent, in every lane under attention DP)."""
    from dsv4.engine.proposer import use_known_answers

    ref, _ = single
    answers = {tuple(p): r for p, r in zip(prompts, ref)}
    sp = [SP8 for _ in prompts] + [SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)]
    sp[1] = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[ref[1][5]])
    want = [r[:r.index(ref[1][5]) + 1] if i == 1 else r for i, r in enumerate(ref)]
    prompts = prompts + [prompts[0]]
    runs, drawn = [], []
    for overlap in (True, False):
        llm = LLM(ckpt, warmup=False, disable_overlap_scheduler=not overlap, speculative_config=MTP2, **KW,
                  **MODES[mode])
        try:
            use_known_answers(llm.engine, answers, 0.7, seed=1)
            group, sent = llm.engine.runner.group, []
            send = group.send
            group.send = lambda m: (sent.append(m), send(m))[1]
            got = _tokens(llm.generate(prompts, sp))
            assert got[:-1] == want and len(got[-1]) == 8
            drawn.append(got[-1])
            st = llm.get_stats()["speculative"]
            runs.append((st["num_accepted_tokens"], st["acceptance_rate"]))
            for lane in range(max(len(m.lanes) for m in sent if isinstance(m, ForwardMsg))):
                shifted = sum(1 for m in sent if isinstance(m, ForwardMsg) and m.lanes[lane].plan.get("unsettled"))
                assert (shifted >= 3) == overlap, (lane, shifted)
            assert llm.engine.overlaps_steps == overlap
        finally:
            llm.shutdown()
    assert runs[0] == runs[1] and 0 < runs[0][1] < 1 and drawn[0] == drawn[1]


PAUSE_OUT = 40  # tokens each request of the pause test generates: pauses, several probes and a resume
RIGHT_FROM = 12  # the step from which the rewritten drafts are right


def _paused_run(llm, prompts, answers, probe_every):
    """The MTP layer's drafts rewritten to wrong ones until step RIGHT_FROM, to the known answer after: drafting
    pauses (steps of one row a request, the MTP layer's keep-up passes), probes every ``probe_every`` paused
    steps and resumes at the first probe after the switch. -> (tokens, the MTP layer's own proposals keyed by
    (prompt, position), the pause's counters)."""
    eng = llm.engine
    assert eng.pause is not None  # (on by default: pause_below_acceptance 0.3)
    eng.pause = DraftPause(0.5, window=2, probe_every=probe_every)
    proposals = {}

    def override(req, drafts):
        done = len(req.output_ids)
        proposals[(tuple(req.prompt_ids), done)] = list(drafts)
        answer = answers[tuple(req.prompt_ids)]
        truth = [answer[done + j] if done + j < len(answer) else d for j, d in enumerate(drafts)]
        return truth if eng.num_steps >= RIGHT_FROM else [(t + 1) % 256 for t in truth]

    rewrite_drafts(eng, override)
    rids = [eng.add_request(p, SamplingParams(max_tokens=PAUSE_OUT, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
    return [eng.requests[r].output_ids for r in rids], proposals, eng.pause.as_dict()


@pytest.mark.parametrize("mode,graphs", [("tp2", False), ("tp2+ep2", True), ("adp2+ep2", False),
                                        ("adp2+ep2", True)])
def test_drafting_pauses_on_every_rank(ckpt, prompts, mode, graphs, monkeypatch):
    """Drafting paused on several ranks (the driver's DraftPause; each plan, a lane's under attention DP, tells
    its rank whether the step keeps the MTP layer's ring up, and how many rows a request): MTP off's tokens
    through pauses, probes and a resume, and the MTP layer's own proposals equal one process's under the same
    schedule (so every rank's ring rows, written by keep-up passes while paused, are right: under TP each rank's
    heads read its own ring, under attention DP each lane's requests live in their rank's ring). Paused steps far
    from a probe leave the ring (with one lane they send no propose message); those near one keep each request's
    last rows. ``graphs``: the graphs' static buffers, where a paused step replays the keep-up runner's buckets
    on every rank."""
    kw = dict(KW, speculative_config=MTP2)
    if graphs:
        monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
        kw["cuda_graph_config"] = {"enable_padding": True, "batch_sizes": [1, 2, 4]}
    ref = _tokens(LLM(ckpt, warmup=False, **KW).generate(prompts, SamplingParams(max_tokens=PAUSE_OUT,
                                                                                  ignore_eos=True)))
    answers = {tuple(p): r for p, r in zip(prompts, ref)}
    one = LLM(ckpt, warmup=False, **kw)
    S = one.engine.cache.layout.swa_cap
    want, want_proposals, want_pause = _paused_run(one, prompts, answers, S + 6)
    assert want == ref
    llm = LLM(ckpt, warmup=False, **kw, **MODES[mode])
    try:
        group, sent = llm.engine.runner.group, []
        send = group.send
        group.send = lambda m: (sent.append(m), send(m))[1]
        got, proposals, pause = _paused_run(llm, prompts, answers, S + 6)
        assert got == ref
        assert pause["num_pauses"] >= 1 and pause["num_resumes"] >= 1 and pause["num_paused_steps"] > S
        common = proposals.keys() & want_proposals.keys()
        if "adp" not in mode:  # one lane: the single process's schedule, step for step
            assert pause == want_pause and proposals.keys() == want_proposals.keys()
        # (attention DP: each lane its own batch limit, so another schedule; the positions both drafted at)
        assert len({k for k in common if k[1] >= RIGHT_FROM}) >= len(prompts)  # (after keep-up passes)
        assert {k: proposals[k] for k in common} == {k: want_proposals[k] for k in common}
        forwards = [m for m in sent if isinstance(m, ForwardMsg)]
        plans = [[w.plan for w in m.lanes if w.plan["req_ids"]] for m in forwards]  # the busy lanes' plans
        far = [all(p.get("mtp_keep_up") is False for p in ps) for ps in plans if ps]
        assert sum(far) > 0 and sum("mtp_keep_last" in p for ps in plans for p in ps) > 0
        proposes = sum(isinstance(m, ProposeMsg) for m in sent)
        assert proposes == len(forwards) - (sum(far) if len(forwards[0].lanes) == 1 else 0)
        if graphs:
            keep = llm.engine.runner.keep_graphs
            assert keep is not None and keep.num_replays > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["tp2", "tp2+ep2"])
def test_whole_step_graphs_on_every_rank(ckpt, prompts, mode, monkeypatch):
    """Greedy MTP steps replay one graph a step on every rank that shares one plan (target pass, verdict,
    catch-up and draft passes: each rank computes the verdict and the drafts from the same logits, so no propose
    message and no broadcast of drafts follows). On the graphs' static buffers, drafting at every step (no pause)
    and paused (the keep-up runner's whole step near a probe, its bare step far from one): every step's drafts
    (the MTP layer's own) and tokens equal one process's on the same buffers, and the tokens are MTP off's."""
    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    kw = dict(KW, speculative_config=MTP2, cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]})
    sp = SamplingParams(max_tokens=PAUSE_OUT, ignore_eos=True)
    ref = _tokens(LLM(ckpt, warmup=False, **KW).generate(prompts, sp))

    def traced(llm, pause):
        eng = llm.engine
        eng.pause = pause
        rids = [eng.add_request(p, sp) for p in prompts]
        trace = []
        while eng.has_unfinished_requests():
            eng.step()
            trace.append([(tuple(eng.requests[r].drafts), len(eng.requests[r].output_ids)) for r in rids])
        assert [eng.requests[r].output_ids for r in rids] == ref
        return trace

    one = LLM(ckpt, warmup=False, **kw)
    S = one.engine.cache.layout.swa_cap
    schedules = [lambda: None, lambda: DraftPause(1.0, window=1, probe_every=S + 6)]
    want = [traced(one, pause()) for pause in schedules]
    llm = LLM(ckpt, warmup=False, **kw, **MODES[mode])
    try:
        group, sent = llm.engine.runner.group, []
        send = group.send
        group.send = lambda m: (sent.append(m), send(m))[1]
        runner = llm.engine.runner
        for pause, trace in zip(schedules, want):
            assert traced(llm, pause()) == trace
        assert runner.graphs.num_whole_steps > 0  # drafting
        assert runner.keep_graphs.num_whole_steps > runner.keep_graphs.num_bare_steps > 0  # paused
        forwards = {m.step: m for m in sent if isinstance(m, ForwardMsg)}
        whole = [n for n, m in forwards.items() if m.whole_step]
        assert len(whole) == runner.graphs.num_whole_steps + runner.keep_graphs.num_whole_steps
        assert not any(forwards[m.step].whole_step for m in sent if isinstance(m, ProposeMsg))
    finally:
        llm.shutdown()


def test_fp32_cell_with_a_stable_prompt_set(ckpt, prompts):
    """The engine's own CPU dtype, on the most involved cell (attention DP + ep2, MTP): with this fixed prompt
    set the cross-rank fp32 sums do not flip any greedy choice (a different set might tie; see the docstring)."""
    kw = dict(KW, dtype="fp32")
    ref = _tokens(LLM(ckpt, warmup=False, **kw).generate(prompts, SP8))
    with LLM(ckpt, warmup=False, speculative_config=MTP2, **kw, **MODES["adp2+ep2"]) as llm:
        assert _tokens(llm.generate(prompts, SP8)) == ref


_TORCHRUN_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from dsv4 import LLM, SamplingParams
ckpt, kw, prompts = json.load(open(sys.argv[1]))
with LLM(ckpt, warmup=False, **kw) as llm:  # ranks >= 1 serve inside the constructor and end there
    out = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in out]), flush=True)
"""


def test_torchrun_launch(ckpt, prompts, single, tmp_path):
    """torchrun starts the processes; rank 0 is the driver, rank 1 serves inside its LLM constructor."""
    script, args = tmp_path / "run.py", tmp_path / "args.json"
    script.write_text(_TORCHRUN_SCRIPT)
    kw = dict(KW, **MODES["tp2+ep2"], speculative_config=MTP2)
    args.write_text(json.dumps([ckpt, kw, prompts]))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(args)], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS")]
    assert len(lines) == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads(lines[0][len("TOKENS "):]) == single[0], res.stdout[-3000:] + res.stderr[-3000:]


def _gone(pids):
    return all(not os.path.exists(f"/proc/{p}") for p in pids)


def test_a_rank_failing_in_warmup_stops_every_rank(ckpt, monkeypatch):
    monkeypatch.setenv("DSV4_INJECT_FAILURE", "1:forward:1")  # rank 1 raises in its first forward
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"rank 1 failed: RuntimeError: injected failure") as ei:
        LLM(ckpt, tensor_parallel_size=2, speculative_config=MTP2, **KW)
    assert time.monotonic() - t0 < 60  # start-up included; the failure itself is seen at once
    assert "warmup path" in str(ei.value)
    err = ei.value
    while not isinstance(err, RankError):
        err = err.__cause__
    assert err.rank == 1 and err.pids and _gone(err.pids)
    assert not torch.distributed.is_initialized()


def test_a_rank_failing_in_a_step_stops_every_rank(ckpt, prompts, monkeypatch):
    monkeypatch.setenv("DSV4_INJECT_FAILURE", "1:propose:3")
    llm = LLM(ckpt, moe_expert_parallel_size=2, enable_attention_dp=True, speculative_config=MTP2, warmup=False,
              **KW)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed: RuntimeError: injected failure .* propose #3") as ei:
        llm.generate(prompts, SP8)
    assert time.monotonic() - t0 < 20
    assert _gone(ei.value.pids)
    with pytest.raises(RankError, match="ranks stopped"):
        llm.generate(prompts[:1], SP8)
    llm.shutdown()  # nothing left to stop; must not raise


@pytest.mark.parametrize("when", ["between steps", "during a step"])
def test_a_killed_rank_is_the_one_blamed(ckpt, prompts, when):
    """SIGTERM to rank 1: rank 0's collective fails with a connection error of its own, but the error names
    rank 1 and its exit code (issue 18, item 6; during a step rank 0 used to be blamed)."""
    import signal
    import threading

    llm = LLM(ckpt, tensor_parallel_size=2, warmup=False, **KW)
    victim = llm._group.procs[0]
    if when == "between steps":
        victim.send_signal(signal.SIGTERM)
        victim.wait(timeout=30)
    else:
        threading.Timer(0.3, victim.send_signal, (signal.SIGTERM,)).start()
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed: the rank's process exited with code -15") as ei:
        for _ in range(50):  # until the signal lands
            llm.generate([p * 8 for p in prompts], SP8)
    assert ei.value.rank == 1 and time.monotonic() - t0 < 20 and _gone(ei.value.pids)


@pytest.mark.parametrize("settings, match", [
    ({"tensor_parallel_size": 3}, "must divide the attention heads"),
    ({"tensor_parallel_size": 2, "enable_attention_dp": True}, "enable_attention_dp needs"),
    ({"enable_attention_dp": True}, "enable_attention_dp needs"),
    ({"pipeline_parallel_size": 2}, "pipeline parallelism is not implemented"),
    ({"moe_expert_parallel_size": 3}, "must divide the routed experts"),
    ({"tensor_parallel_size": 2, "moe_expert_parallel_size": 4}, "use tensor_parallel_size 1 or 4"),
])
def test_refusals_at_construction(ckpt, settings, match):
    with pytest.raises(EngineConfigError, match=match):
        LLM(ckpt, **KW, **settings)
    assert not torch.distributed.is_initialized()


def test_more_ranks_than_cuda_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    m = ParallelMapping.from_engine_config(EngineConfig(tensor_parallel_size=2))
    with pytest.raises(EngineConfigError, match="need 2 CUDA devices"):
        m.check_devices("cuda")


@pytest.mark.parametrize("mode", list(MODES) + ["tp4-ep2"])
def test_shards_cover_the_model_exactly_once(mode):
    """Concatenating the ranks' slices gives back every split tensor; the rest is replicated."""
    cfg = get_preset("tiny").replace(num_heads=8, o_groups=4)
    sd = random_state_dict(cfg, seed=0)
    settings = MODES.get(mode, {"tensor_parallel_size": 4, "moe_expert_parallel_size": 2})
    m = ParallelMapping.from_engine_config(EngineConfig(**settings))
    shards = [shard_state_dict(sd, cfg, m.with_rank(r)) for r in range(m.world_size)]
    for name, full in sd.items():
        parts = [s[name] for s in shards]
        if all(p.shape == full.shape for p in parts):
            assert all(torch.equal(p, full) for p in parts), name
            continue
        if name.endswith("experts.w2"):  # [E, d, I]: experts over ep ranks, I over moe_tp
            rows = [torch.cat(parts[e * m.moe_tp:(e + 1) * m.moe_tp], dim=2) for e in range(m.ep)]
            assert torch.equal(torch.cat(rows, 0), full), name
        elif name.endswith(("experts.w1", "experts.w3")):  # [E, I, d]
            rows = [torch.cat(parts[e * m.moe_tp:(e + 1) * m.moe_tp], dim=1) for e in range(m.ep)]
            assert torch.equal(torch.cat(rows, 0), full), name
        elif name.endswith("wo_b.weight"):
            assert torch.equal(torch.cat(parts, 1), full), name
        else:  # wq_b / wo_a rows, attn_sink
            assert torch.equal(torch.cat(parts, 0), full), name
            assert ".attn." in name and "indexer" not in name, name


@pytest.mark.parametrize("settings", [{"moe_expert_parallel_size": 2},
                                      {"tensor_parallel_size": 4, "moe_expert_parallel_size": 2},
                                      {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2}])
def test_rank_reads_only_its_experts(ckpt, settings):
    """What a rank builds from its read share of the checkpoint (its routed experts only) equals what it
    would slice from the whole checkpoint."""
    from dsv4.model.loader import load_state
    from dsv4.parallel.shard import rank_experts

    cfg, full, _ = load_state(ckpt)
    m = ParallelMapping.from_engine_config(EngineConfig(**settings))
    for r in range(m.world_size):
        mr = m.with_rank(r)
        experts = rank_experts(cfg, mr)
        assert len(experts) == cfg.n_routed_experts // m.ep
        _, part, _ = load_state(ckpt, experts=experts)
        assert part["layers.0.ffn.experts.w1"].shape[0] == len(experts)
        a, b = shard_state_dict(full, cfg, mr), shard_state_dict(part, cfg, mr)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- CUDA graphs on several ranks: the static-buffer path (capture=False) on the CPU -------------------------------
@pytest.mark.parametrize("mode", ["tp2", "ep2", "adp2+ep2"])
def test_graph_path_on_every_rank_token_identical(ckpt, prompts, single, mode, monkeypatch):
    """Every rank builds the same buckets and replays them for the same steps (the driver's decision, sent
    with the step): target, MTP catch-up and draft passes through the static tables, collectives included.
    The switch is read by the worker processes too (a monkeypatch of CudaBackend.supports would not reach
    them)."""
    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    ref, ref_proposals = single
    llm = LLM(ckpt, speculative_config=MTP2, cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]},
              **KW, **MODES[mode])
    try:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and not graphs.capture and graphs.buckets == [1, 2, 4]
        assert graphs.num_replays > 0  # warmup's decode and verify steps replayed on every rank
        before = graphs.num_replays
        proposals = {}
        rewrite_drafts(llm.engine, _oracle({tuple(p): r for p, r in zip(prompts, ref)}, proposals))
        assert _tokens(llm.generate(prompts, SP8)) == ref
        assert graphs.num_replays > before
        common = proposals.keys() & ref_proposals.keys()
        assert len(common) >= len(prompts)
        assert {k: proposals[k] for k in common} == {k: ref_proposals[k] for k in common}
        assert graphs.matches(_any_plan(graphs)) and not graphs.released
        llm.shutdown()  # the driver's graphs go before its process groups (NCCL waits for them otherwise)
        assert graphs.released and not graphs.matches(_any_plan(graphs))
        assert graphs.num_replays > before  # counts stay for the bench report
    finally:
        llm.shutdown()


def _any_plan(graphs):
    """The shape of a plan padded to the largest bucket."""
    from types import SimpleNamespace

    from dsv4.cache.plan import padded_shape

    B, rows = max(graphs.buckets), graphs.rows
    shape = padded_shape(graphs.storage.layout, B, B * rows, graphs.max_blocks, graphs.max_entries)
    return SimpleNamespace(shape=shape, num_new=[rows] * B)


@pytest.mark.parametrize("first", [0, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_experts_grouped_path_equals_the_loop(first, dtype):
    """The graph-safe grouped path of the split experts (CUDA) against its torch-loop twin, on the CPU: pairs
    routed to the other rank's experts contribute exactly nothing."""
    from dsv4.parallel.shard import ParallelExperts

    cfg = get_preset("tiny")
    E, k = cfg.n_routed_experts, cfg.n_experts_per_tok
    g = torch.Generator().manual_seed(first)
    m = ParallelExperts(cfg, E // 2, first, cfg.moe_inter_dim, None, gather_tokens=False).to(dtype)
    for p in m.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=dtype) * 0.1
    N = 37
    x = torch.randn(N, cfg.hidden_size, generator=g, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    ids[0] = torch.arange(E // 2, E // 2 + k) if first == 0 else torch.arange(k)  # a token with no local expert
    w = torch.rand(N, k, generator=g)
    loop, grouped = m._local_loop(x, w, ids), m._local_grouped(x, w, ids)
    assert torch.equal(grouped[0], torch.zeros_like(grouped[0]))
    torch.testing.assert_close(grouped, loop, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-6)
