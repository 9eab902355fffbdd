"""MTP draft fidelity: every draft the engine proposes equals the dense reference's draft.

The engine drafts through its cache: the MTP layer's catch-up pass over each step's rows (its row of the
newest committed position gives draft 1), then draft passes 2..k, one token each, whose windows read the MTP
layer's ring (R1). The dense reference recomputes the same drafts from position 0 with no cache
(``DenseBackend``), as ``DeepseekV4.mtp_logits`` defines the MTP layer, chained the way the engine chains it:

    committed length n (tokens t_0..t_n known, t_n sampled last), main streams X_0..X_{n-1}
    MTP pass j runs the MTP layer over n + j - 1 rows:
        rows p = 0..n-1 : (X_p, t_{p+1})                 the main streams and the token after them
        row  n + i - 1  : (Y_i, d_i)  for i = 1..j-1       Y_i = MTP output streams of pass i's last row
    draft j = argmax of the MTP logits of the last row; Y_j = its MTP streams.

So the MTP row at position q sits at position q: its window holds the MTP rows of q-W+1..q-1, the rows of
committed positions made from the main streams (what the catch-up passes wrote into the ring), and the rows
of the earlier drafts of the same series (what draft passes 2..j-1 wrote). Each pass j >= 2 is fed the
engine's own draft d_{j-1} (teacher forcing), so every draft position is judged on its own.

The model is the trained built-in ``mini`` (its MTP drafts are right most of the time, so both branches of
acceptance run on real drafts), with held-out prompts of mixed lengths. ``MODEL`` may name any checkpoint or
preset: with a random preset (``tiny``) the MTP drafts are almost never right, which is why every run also
has a twin with a test-only drafter (``proposer.use_known_answers``) that replaces the drafts by the known answer
part of the time (the MTP's own drafts are still the ones checked against the dense reference).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.cache.plan import DraftTables
from dsv4.engine.proposer import use_known_answers
from dsv4.engine.spec import DeviceVerdict
from dsv4.model.dense import DenseBackend


MODEL = "mini"  # the trained built-in model; any preset name or checkpoint directory works too
# token-id prompts, or None: random prompts sized from the model config (for a preset such as "tiny")
PROMPT_LENGTHS = (40, 140, 300, 470)  # held-out prompts of about these lengths: under and past the window (128),
#                                       past the HCA ratio (128) and past 4 x (index_topk + 1) = 260 tokens
MAX_TOKENS = 16
MAX_NUM_TOKENS = 16  # a small token budget: the longer prompts prefill in several chunks
MAX_SEQ_LEN = 512
DRAFT_LENS = (1, 2, 3)
# A mismatch where the dense logits of the two tokens are this close (relative to the largest |logit|) is a
# near-tie between two fp32 paths, not a wrong draft (reported, not failed). On tiny the engine's MTP logits
# agree with the dense ones to ~3e-6 and the closest top-2 gap is ~1.6e-2; the faults below move drafts by
# far more.
TIE_RTOL = 1e-4
# The engine's MTP logits themselves must agree with the dense ones this closely (relative to max |logit|).
LOGIT_RTOL = 1e-3

MTP = lambda k: {"decoding_type": "MTP", "num_nextn_predict_layers": k}  # noqa: E731


@pytest.fixture(scope="module")
def model_name():
    return MODEL


def _llm(model: str, k: int = 0, **kw) -> LLM:
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_num_tokens", MAX_NUM_TOKENS)
    kw.setdefault("max_seq_len", MAX_SEQ_LEN)
    kw.setdefault("kv_cache_config", {"max_tokens": 4096})
    kw.setdefault("dtype", "fp32")
    return LLM(model, warmup=False, speculative_config=MTP(k) if k else None, **kw)


def prompt_lengths(cfg) -> list[int]:
    """Lengths that cross the model's boundaries: shorter than the window, just past it, and long enough for
    two windows of the largest compress ratio and more ratio-4 entries than the indexer's top-k (decoding
    then crosses further boundaries). Capped by MAX_SEQ_LEN."""
    W, R = cfg.window_size, max(cfg.ratios, default=1)
    long = max(2 * R, 4 * (cfg.index_topk + 1)) + 3 if 4 in cfg.ratios else 2 * R + 3
    return sorted({1, max(2, W // 2), W + 3, min(long, MAX_SEQ_LEN - MAX_TOKENS)})


def heldout_prompt_ids(model_name: str, lengths) -> list[list[int]]:
    """For each wanted length, the shipped held-out prompt whose token count is nearest to it (without going
    past it)."""
    from dsv4.builtin import builtin_path, heldout_prompts
    from dsv4.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(builtin_path(model_name))
    ids = [tok.encode(p).ids for p in heldout_prompts(model_name)]
    return [max((p for p in ids if len(p) <= L), key=len) for L in lengths]


@pytest.fixture(scope="module")
def prompts(model_name):
    from dsv4.builtin import BUILTIN_MODELS
    from dsv4.model.loader import model_config

    if model_name in BUILTIN_MODELS:
        return heldout_prompt_ids(model_name, PROMPT_LENGTHS)

    cfg = model_config(model_name)
    rng = random.Random(0)
    return [[rng.randrange(2, cfg.vocab_size) for _ in range(L)] for L in prompt_lengths(cfg)]


# ---- what the engine did -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proposal:
    """The MTP's drafts for one request after one step (before any test-only override)."""

    rid: str
    tokens: tuple[int, ...]  # the request's tokens when it drafted: t_0 .. t_n
    new_len: int  # n, the committed length after the step's acceptance
    drafts: tuple[int, ...]
    logits: tuple[torch.Tensor, ...]  # the MTP logits [V] each draft was taken from


@dataclass(frozen=True)
class Verify:
    """One verify of one request: the drafts it checked and how many of them it accepted."""

    rid: str
    num_computed: int  # C: the verify's rows are positions C .. C + k
    drafts: tuple[int, ...]
    accepted: int


@dataclass
class Run:
    prompts: list[list[int]]
    outputs: list[list[int]]
    rids: list[str]
    proposals: list[Proposal] = field(default_factory=list)
    verifies: list[Verify] = field(default_factory=list)
    stats: dict | None = None
    model: object = None
    partial_chunks: int = 0  # prefill chunks that did not reach the end of their prompt
    device_verdicts: int = 0  # steps whose drafts were launched from acceptance still on the device
    whole_steps: int = 0  # steps that ran as one CUDA graph (verify, acceptance and drafts)
    prefill_replays: int = 0  # prefill chunks that replayed a prefill graph
    pending: list = field(default_factory=list)  # what ``capture`` saw in the step now running

    def flush(self) -> None:
        for record in self.pending:
            record()
        self.pending.clear()
    mixed_steps: int = 0  # steps that verified drafts and prefilled a chunk together


def capture(engine, run: Run):
    """Wrap the runner's ``propose`` (the one place drafts are made): it receives the step's verified drafts
    (``seqs[b].drafts``, or on the device after an overlapped step) and accepted counts (host ints, or a verdict
    still on the device) and returns the MTP's new drafts; the ``choose`` callback it is handed sees the MTP
    logits each draft is taken from. What it saw is recorded at the end of the run (``Run.flush``): with the
    overlap scheduler a step's tokens are appended a step later, and a step may run for a request that had
    already ended (its results are dropped: its records are too)."""
    real = engine.runner.propose

    def propose(seqs, plan, target, num_accepted, drafting, draft_len, choose):
        logits: dict[int, list[torch.Tensor]] = {}

        def choose_and_keep(rows, lg, positions):
            for i, b in enumerate(rows):
                logits.setdefault(b, []).append(lg[i].detach().float().cpu().clone())
            return choose(rows, lg, positions)

        drafts = real(seqs, plan, target, num_accepted, drafting, draft_len, choose_and_keep)
        run.pending.append(lambda: _record(run, seqs, plan, num_accepted, drafting, drafts, logits))
        return drafts

    engine.runner.propose = propose


def _record(run: Run, seqs, plan, num_accepted, drafting, drafts, logits) -> None:
    verified = [s.drafts for s in seqs]
    if isinstance(num_accepted, DeviceVerdict):
        _, num_accepted, verified = num_accepted.read_all()  # (the drafts as the device verified them)
        run.device_verdicts += 1
    computed = plan.rows[:len(seqs)].tolist()  # C of each seq (an overlapped step's is known on the device)
    drafts = drafts.tolist()
    run.partial_chunks += sum(1 for s in seqs if not s.sample)
    prefill = [C + s.num_new <= len(s.request.prompt_ids) for s, C in zip(seqs, computed)]
    run.mixed_steps += any(s.drafts for s in seqs) and any(prefill)
    for b, s in enumerate(seqs):
        req = s.request
        final = req.tokens
        if s.drafts and computed[b] < len(final) - 1:  # (a later one ran after the request had ended)
            run.verifies.append(Verify(req.request_id, computed[b], tuple(verified[b]), num_accepted[b] - 1))
        n = computed[b] + num_accepted[b]
        if drafting[b] and n + 1 < len(final):  # a request that ended at this step drafts for nothing
            run.proposals.append(Proposal(req.request_id, tuple(final[:n + 1]), n, tuple(drafts[b]),
                                          tuple(logits[b])))


def run_engine(model: str, prompts, k: int, *, answers=None, seed: int = 0, after_step=None, patches=(),
               whole_step: bool | None = None, **llm_kw) -> Run:
    """Generate greedily with MTP k (k = 0: off), chunked prefill, the cache's integrity check after every
    step; record every proposal and verify. ``answers`` (prompt -> MTP off's output): a known-answer drafter
    replaces 60% of the drafts by the answer (``proposer.use_known_answers``; MTP steps still overlap).
    ``whole_step`` False: CUDA graph buckets replay the separate graphs (target, MTP passes), so that every
    proposal goes through ``runner.propose`` and is recorded (a whole-step graph's drafts are not).
    ``llm_kw`` go to ``LLM`` (e.g. device="cuda")."""
    with pytest.MonkeyPatch.context() as mp:
        for obj, name, value in patches:
            mp.setattr(obj, name, value)
        llm = _llm(model, k, **llm_kw)
        eng = llm.engine
        if whole_step is not None and eng.runner.graphs is not None:
            eng.runner.graphs.whole_step = whole_step
        run = Run([list(p) for p in prompts], [], [], model=llm.model)
        if k:
            capture(eng, run)
        if answers is not None:
            use_known_answers(eng, answers, 0.6, seed=seed)
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        run.rids = [eng.add_request(p, sp) for p in prompts]
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
            if after_step is not None:
                after_step(eng, steps)
        run.flush()
        run.outputs = [list(eng.requests[r].output_ids) for r in run.rids]
        assert eng.cache.num_free_blocks == eng.cache.num_blocks
        eng.cache.check_integrity()
        run.stats = llm.get_stats()["speculative"]
        run.whole_steps = eng.runner.graphs.num_whole_steps if eng.runner.graphs is not None else 0
        run.prefill_replays = eng.runner.graphs.num_prefill_replays if eng.runner.graphs is not None else 0
    return run


# ---- the dense reference ---------------------------------------------------------------------------------
def _dense(model, T: int) -> DenseBackend:
    return DenseBackend(1, T, model.cfg.window_size, torch.device("cpu"))


@torch.no_grad()
def dense_main_streams(model, ids: list[int]) -> torch.Tensor:
    """The main model's last-layer streams [T, n, d] of one sequence, from position 0, no cache."""
    x = torch.tensor(ids, dtype=torch.long)
    return model.streams(x, _dense(model, len(ids)))


@torch.no_grad()
def dense_main_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], dtype=torch.long))[0]


def _scale(logits: torch.Tensor) -> float:
    return max(1.0, float(logits.abs().max()))


def _judge(logits: torch.Tensor, got: int) -> tuple[int, str | None]:
    """(dense argmax, None / "tie" / "mismatch") for the engine's token ``got``."""
    want = int(logits.argmax())
    if want == got:
        return want, None
    gap = float(logits[want] - logits[got])
    return want, ("tie" if gap <= TIE_RTOL * _scale(logits) else "mismatch")


@torch.no_grad()
def dense_draft_check(model, main_streams: torch.Tensor, p: Proposal) -> tuple[list[dict], float]:
    """Recompute proposal ``p``'s drafts densely (see the module docstring). Returns one finding per draft
    that differs from the engine's, and the largest |engine - dense| MTP logit over its drafts (relative to
    max |logit|)."""
    n = p.new_len
    X = main_streams[:n]  # streams at 0 .. n-1
    ids = list(p.tokens[1:n + 1])  # t_1 .. t_n
    findings, err = [], 0.0
    for j, (got, engine_logits) in enumerate(zip(p.drafts, p.logits), start=1):
        Y = model.mtp_streams(X, torch.tensor(ids, dtype=torch.long), _dense(model, X.shape[0]))
        logits = model.mtp_logits_from_streams(Y[-1:])[0]
        err = max(err, float((logits - engine_logits).abs().max()) / _scale(logits))
        want, verdict = _judge(logits, got)
        if verdict is not None:
            findings.append({"rid": p.rid, "new_len": n, "draft": j, "engine": got, "dense": want,
                             "gap": float(logits[want] - logits[got]), "kind": verdict})
        X = torch.cat([X, Y[-1:]])  # pass j+1: this pass's output streams at the new row ...
        ids.append(got)  # ... with the engine's draft j (teacher forcing)
    return findings, err


@dataclass
class DraftCheck:
    mismatches: list[dict]
    ties: list[dict]
    checked: int  # drafts compared
    logit_err: float  # largest relative |engine - dense| MTP logit


def check_drafts(run: Run) -> DraftCheck:
    """Every proposal of the run against the dense reference."""
    model = run.model
    finals = {rid: p + o for rid, p, o in zip(run.rids, run.prompts, run.outputs)}
    streams = {}
    out = DraftCheck([], [], 0, 0.0)
    for p in run.proposals:
        final = finals[p.rid]
        assert list(p.tokens) == final[:len(p.tokens)], f"request {p.rid}: tokens changed after drafting"
        if p.rid not in streams:  # causal: the streams of a prefix are those of the final sequence
            streams[p.rid] = dense_main_streams(model, final)
        findings, err = dense_draft_check(model, streams[p.rid], p)
        for f in findings:
            (out.mismatches if f["kind"] == "mismatch" else out.ties).append(f)
        out.checked += len(p.drafts)
        out.logit_err = max(out.logit_err, err)
    return out


@torch.no_grad()
def dense_greedy_check(run: Run, extra: int) -> dict[str, list[int]]:
    """Teacher-forced: every output token is the dense main model's argmax (up to near-ties); returns each
    request's final sequence extended by ``extra`` dense greedy tokens (to judge drafts past its end)."""
    ext = {}
    for rid, prompt, out in zip(run.rids, run.prompts, run.outputs):
        seq = prompt + out
        logits = dense_main_logits(run.model, seq)
        P = len(prompt)
        for i, t in enumerate(out):
            want, verdict = _judge(logits[P - 1 + i], t)
            assert verdict != "mismatch", f"request {rid}: output {i} is {t}, dense greedy gives {want}"
        seq = seq + [int(logits[-1].argmax())]
        for _ in range(extra - 1):
            seq.append(int(dense_main_logits(run.model, seq)[-1].argmax()))
        ext[rid] = seq
    return ext


def dense_accepted(seq: list[int], v: Verify) -> int:
    """Greedy acceptance recomputed: the longest prefix of the drafts d_1..d_k (for positions C+1..C+k) that
    equals the dense greedy sequence there. Draft d_i is judged by the verify row at C+i-1, which sees
    t_0..t_C, d_1..d_{i-1}: while every earlier draft was accepted that is the greedy sequence's own prefix,
    so the target's token there is the greedy sequence's token at C+i."""
    a = 0
    for i, d in enumerate(v.drafts):
        if d != seq[v.num_computed + 1 + i]:
            break
        a += 1
    return a


# ---- runs shared by the tests ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(model_name, prompts) -> Run:
    """MTP off."""
    return run_engine(model_name, prompts, 0)


@pytest.fixture(scope="module")
def runs(model_name, prompts, reference):
    memo = {}

    def get(k: int, drafter: str) -> Run:
        if (k, drafter) not in memo:
            answers = None
            if drafter == "oracle":
                answers = {tuple(p): o for p, o in zip(reference.prompts, reference.outputs)}
            memo[k, drafter] = run_engine(model_name, prompts, k, answers=answers, seed=k)
        return memo[k, drafter]

    return get


DRAFTERS = ("mtp", "oracle")


# ---- 1. every draft equals the dense reference's ---------------------------------------------------------
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("k", DRAFT_LENS)
def test_drafts_equal_dense_chained_drafts(runs, prompts, k, drafter):
    run = runs(k, drafter)
    assert run.device_verdicts > 0  # drafts launched from acceptance on the device (greedy, one device)
    # every drafting request proposed k drafts at every step that ended at its newest token
    assert run.proposals and all(len(p.drafts) == k for p in run.proposals)
    if max(map(len, prompts)) > MAX_NUM_TOKENS:
        assert run.partial_chunks > 0 and run.mixed_steps > 0  # chunked prefill, beside verify steps
    c = check_drafts(run)
    assert c.checked == k * len(run.proposals)
    assert not failures(c), failures(c)


def failures(c: DraftCheck) -> list[str]:
    """What makes a run's drafts wrong: a draft token the dense reference does not give, too many near-ties,
    or MTP logits off the dense ones."""
    out = []
    if c.mismatches:
        out.append(f"{len(c.mismatches)} of {c.checked} drafts differ from the dense reference, first:"
                   f" {c.mismatches[:5]}")
    if len(c.ties) > max(1, c.checked // 50):
        out.append(f"suspiciously many near-ties: {c.ties[:5]}")
    if c.logit_err > LOGIT_RTOL:
        out.append(f"MTP logits differ from the dense ones by {c.logit_err:.2e} (relative)")
    return out


# ---- 2. the check has power --------------------------------------------------------------------------------
def _corrupt_mtp_ring(after: int, scale: float = 1e3):
    """After step ``after``, overwrite every row of the MTP layer's SWA ring with large random values (the
    target layers never read it, so the output must not change; the drafts must)."""
    def hook(eng, step):
        if step == after:
            st = eng.storage
            ring = st.swa[eng.model_cfg.num_layers]
            assert not st.fp8
            g = torch.Generator().manual_seed(step)
            ring.copy_(scale * torch.randn(ring.shape, generator=g, dtype=torch.float32).to(ring.dtype))
    return hook


def _skip_draft_writes():
    """A plausible engine bug: draft passes 2..k do not write their row into the MTP ring (they write the
    null row), so draft j >= 3 reads the stale catch-up row at the newest committed position + 1."""
    real = DraftTables.step_tables

    def step_tables(self, j, new_lens):
        t = real(self, j, new_lens)
        return dataclasses.replace(t, swa_write=torch.zeros_like(t.swa_write))
    return [(DraftTables, "step_tables", step_tables)]


@pytest.mark.parametrize("fault", ["ring_overwritten", "draft_rows_not_written"])
def test_a_broken_mtp_window_is_detected(model_name, prompts, reference, fault):
    k = 3
    if fault == "ring_overwritten":
        run = run_engine(model_name, prompts, k, after_step=_corrupt_mtp_ring(after=4))
    else:
        run = run_engine(model_name, prompts, k, patches=_skip_draft_writes())
    assert run.outputs == reference.outputs  # the fault only touches drafts: greedy output is unchanged
    c = check_drafts(run)
    assert failures(c), f"a {fault} MTP window went unnoticed over {c.checked} drafts"
    if fault == "ring_overwritten":  # a whole window of garbage changes draft tokens, not only logits
        assert c.mismatches


# ---- 3. accepted counts equal the dense reference's --------------------------------------------------------
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("k", DRAFT_LENS)
def test_accepted_counts_equal_dense_greedy_prefix(runs, k, drafter):
    run = runs(k, drafter)
    seqs = dense_greedy_check(run, extra=k)
    per_step = [(v.rid, v.num_computed, v.accepted, dense_accepted(seqs[v.rid], v)) for v in run.verifies]
    wrong = [s for s in per_step if s[2] != s[3]]
    assert not wrong, f"(request, C, engine accepted, dense accepted): {wrong[:8]}"
    st = run.stats
    assert st["num_verify_steps"] == len(run.verifies)
    assert st["num_draft_tokens"] == sum(len(v.drafts) for v in run.verifies)
    assert st["num_accepted_tokens"] == sum(s[3] for s in per_step)
    assert st["accepted_per_position"] == [sum(1 for s in per_step if s[3] > j) for j in range(k)]
    if drafter == "oracle":  # both branches ran
        assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"]


# ---- 4. greedy output is the same with MTP on and off --------------------------------------------------------
@pytest.mark.parametrize("k", DRAFT_LENS)
def test_greedy_output_with_mtp_equals_mtp_off(runs, reference, k):
    for drafter in DRAFTERS:
        assert runs(k, drafter).outputs == reference.outputs, drafter
    dense_greedy_check(reference, extra=1)  # and MTP off is the dense model's greedy output
