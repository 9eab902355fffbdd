"""The engine step: schedule -> plan -> run the target -> sample / verify -> propose drafts -> commit.

Speculation is its own stage: a ``Proposer`` (``proposer.py``; the MTP layer's by default) drafts the next
step's tokens after acceptance; the runner only offers forward passes. While drafts are not accepted often
enough the engine's ``DraftPause`` (``spec_pause.py``) pauses drafting: steps of one row a request, the MTP
layer only keeping its cache current.

``LLMEngine`` is what the LLM API and the benchmark drive: ``add_request`` then ``step`` until
``has_unfinished_requests`` is false. Every step's per-step state lives in one immutable plan the cache
builds (R2); the cache's integrity check runs after every step when ``DSV4_CHECK_CACHE=1``.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from ..cache.manager import SeqStep
from ..config import ModelConfig
from ..transfer import HostCopy, to_device
from .mtp_rows import max_kept_rows
from .outputs import CompletionOutput, RequestOutput
from .proposer import DeviceProposals, MtpProposer, Proposer
from .protocols import StepCache, StepScheduler
from .request import InFlight, Request, Status
from .runner import LaunchedStep, ModelRunner, TargetOutput, target_inputs
from .sampler import StepLogprobs, greedy_tokens, request_key, sample_rows
from .sampling_params import SamplingParams, plain_ints
from .scheduler import Scheduler, ScheduledSeq
from .spec_pause import DraftPause
from .spec import (DeviceVerdict, SpecStats, accept_greedy, accept_on_device, accept_sampled,
                   verdict_of_step_graph)

log = logging.getLogger("dsv4")


@dataclass(frozen=True)
class LaunchedMtp:
    """What the host reads of an overlapped MTP step (``LaunchedStep.mtp``)."""

    plan: object  # its StepPlan: the cache settles its accepted drafts (``cache.settle``)
    verdict: DeviceVerdict
    proposals: DeviceProposals
    epochs: tuple[int, ...]  # per seq: its request's num_preemptions at launch (one preempted since holds no rows)


class RequestError(ValueError):
    """A request this engine cannot serve (too long, bad token ids); only that request is refused."""


class LLMEngine:
    num_lanes = 1  # attention-DP lanes, each with its own batch limits (the multi-rank driver may have several)

    def __init__(self, model, model_cfg: ModelConfig, cache: StepCache, storage, engine_cfg, max_seq_len: int,
                 tokenizer=None, runner: ModelRunner | None = None, scheduler: StepScheduler | None = None,
                 proposer: Proposer | None = None):
        """``runner``, ``scheduler``, ``proposer``: the single-device ones unless given (the multi-rank
        driver gives its own runner and, under attention DP, its lanes' scheduler)."""
        self.model, self.model_cfg, self.cfg = model, model_cfg, engine_cfg
        self.cache, self.storage = cache, storage
        self.max_seq_len = max_seq_len
        self.tokenizer = tokenizer
        self.device = torch.device(engine_cfg.device)
        self.draft_len = engine_cfg.draft_len
        self.runner = runner or ModelRunner(model, storage, self.device, engine_cfg.attention_backend)
        self.runner.mtp_rows_max = max_kept_rows(engine_cfg.max_num_tokens, engine_cfg.max_batch_size,
                                                 storage.layout.swa_cap)
        self.scheduler = scheduler or Scheduler(cache, engine_cfg.max_batch_size, engine_cfg.max_num_tokens,
                                                prefill_alone=engine_cfg.batch_invariant)
        # speculation's propose stage (None without MTP); tests and benchmarks may wrap it (RewrittenProposer)
        self.proposer: Proposer | None = proposer or (MtpProposer(self.runner, self.draft_len)
                                                      if self.draft_len else None)
        self.spec_stats = SpecStats()
        # drafting paused while it does not pay (spec_pause.py; the single-device runner's keep-up passes)
        spec = engine_cfg.speculative_config
        self.pause = (DraftPause(spec.pause_below_acceptance, probe_every=spec.pause_probe_interval,
                                  max_probe_every=spec.pause_max_probe_interval)
                      if self.draft_len and spec.pause_below_acceptance > 0 and self.runner.pauses_drafting
                      else None)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_step: dict = {}  # a summary of the last step (for iteration logs)
        # the overlap scheduler (see ``step``); a benchmark may switch it between steps
        self.overlap_scheduler = not engine_cfg.disable_overlap_scheduler
        self._pending: LaunchedStep | None = None  # the overlapped step whose tokens are not read back yet

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None) -> str:
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        ids = list(prompt_token_ids)
        if not plain_ints(ids):  # (plain ints, the usual case, need no conversion: 0.2 ms at 8k)
            ids = [int(t) for t in ids]
        if not ids:
            raise RequestError(f"request {rid!r}: the prompt is empty")
        V = self.model_cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestError(f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary [0, {V})")
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise RequestError(f"request {rid!r}: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) ="
                               f" {len(ids) + params.max_tokens} exceeds max_seq_len ({self.max_seq_len});"
                               " shorten the request or raise max_seq_len")
        req = Request(rid, ids, params, key=request_key(params.seed), eos_token_id=self.model_cfg.eos_token_id,
                      prompt=prompt)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str):
        req = self.requests.pop(str(request_id), None)
        if req is not None and not req.finished:
            req.finish_reason = "abort"
            self.scheduler.finish(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs of the requests that gained tokens or finished.

        With the overlap scheduler a step is launched and left running: its tokens are read back in the next
        call, after that call has launched the next step (whose inputs come straight from the device), so each
        call returns the previous step's tokens. With MTP the launched step verifies on the device and leaves
        its acceptance and drafts there too: the next step's positions come from the device (the cache plan's
        C column), its inputs are the device's bonus token and drafts, and the step's accepted rows are
        committed in two parts: those every outcome keeps at once, the rest (``cache.settle``) when read back.
        A step that cannot overlap (overlap disabled, a proposer that drafts on the host) reads its own tokens
        as before.
        """
        prev, self._pending = self._pending, None
        early: list[RequestOutput] = []
        if prev is not None and prev.mtp is not None and not self.overlaps_steps:  # switched off meanwhile
            early, prev = self._settle(*self._resolve(prev)), None
        seqs = self.scheduler.schedule()
        if not seqs:  # (every request waits for tokens on the device: a call that only reads them back)
            done = self._resolve(prev) if prev is not None else ([], [])
            self.last_step = {"step": self.num_steps, "num_seqs": 0, "num_tokens": 0, "num_context": 0,
                              "num_generation": 0, "num_emitted": sum(len(e) for e in done[1]),
                              "num_free_blocks": self.cache.num_free_blocks}
            return early + self._settle(*done)
        # (for the iteration log: counted before the step moves its requests on)
        num_context = sum(1 for s in seqs if not s.request.in_decode or not s.sample)
        mtp = self.draft_len > 0
        drafting, keep_last = self._drafting_and_keep_up(seqs) if mtp else (False, None)
        plan = self.cache.begin_step(
            [SeqStep(s.request.request_id, s.num_new, self.draft_len if (drafting and s.sample) else 0)
             for s in seqs],
            device=self.device, shift=self._shift(seqs, prev), mtp_keep_up=keep_last != 0,
            mtp_keep_last=keep_last or None, **self.runner.padding_for(seqs))
        done: tuple[list, list] = ([], [])
        launched, committed = None, False
        try:
            target = self.runner.forward(seqs, plan, prev, whole_step=self._whole_step(seqs, plan, drafting))
            if self._overlaps(seqs):
                launched = self._launch_mtp(seqs, plan, target, drafting) if mtp else self._launch(seqs, plan, target)
                # the rows every outcome keeps (an MTP step's accepted drafts settle when they are read back)
                accepted, emitted = [s.num_new - len(s.drafts) for s in seqs], [[] for _ in seqs]
                self._commit(plan, seqs, accepted, [len(s.drafts) for s in seqs])
                committed = True
            if prev is not None:
                done, prev = self._resolve(prev), None
            if launched is None:
                accepted, emitted = self._run(seqs, plan, target, mtp, drafting)
        except BaseException:
            # the step's rows may be half written: the cache frees its requests; they end with an error, and
            # so do those of an overlapped step whose tokens were not read back
            if not committed:
                self.cache.abort_step(plan)
            for s in seqs:
                s.request.finish_reason = "error"
                if committed:
                    self.scheduler.finish(s.request)
                else:
                    self.scheduler.forget(s.request)
            for s in (prev.seqs if prev is not None else ()):
                if not s.request.finished:
                    s.request.finish_reason = "error"
                    self.scheduler.finish(s.request)
            self._settle(*done)  # an overlapped step read back before the failure: release what it ended
            raise
        if not committed:
            self._commit(plan, seqs, accepted)
        self._pending = launched
        self.num_steps += 1
        outs = early + self._settle(*done) + self._settle(seqs, emitted)
        self.last_step = {"step": self.num_steps, "num_seqs": len(seqs),
                          "num_tokens": sum(s.num_new for s in seqs),
                          "num_context": num_context, "num_generation": len(seqs) - num_context,
                          "num_emitted": sum(len(e) for e in done[1]) + sum(len(e) for e in emitted),
                          "num_free_blocks": self.cache.num_free_blocks}
        return outs

    def _commit(self, plan, seqs: list[ScheduledSeq], accepted: list[int], unsettled: list[int] | None = None):
        self.cache.commit_step(plan, accepted, unsettled)
        for s, a in zip(seqs, accepted):
            s.request.num_computed += a

    def _settle(self, seqs: list[ScheduledSeq], emitted: list[list[int]]) -> list[RequestOutput]:
        """Release the requests that finished (outside any active step) and build the outputs of those that
        gained tokens or finished."""
        outs = []
        for s, new in zip(seqs, emitted):
            req = s.request
            ended = req.finish_reason is not None and not req.finished
            if ended:
                req.finish_time = time.perf_counter()
                self.scheduler.finish(req)
            if new or ended:
                outs.append(self._output(req))
        return outs

    def _drafting_and_keep_up(self, seqs: list[ScheduledSeq]) -> tuple[bool, int | None]:
        """Whether this MTP step's requests propose drafts for the next (``_drafts_now``; held back while a
        request's MTP ring holds rows a paused step left stale), and how many of each request's last rows the
        step writes to the MTP layer's ring (None: all its MTP pass keeps, always where it drafts; 0: none;
        ``DraftPause.keep_rows``). A paused step far from the next probe leaves a prompt's rows stale too: the
        ring's span of keep-up steps before the probe moves them out of the window, as it does a decode row's;
        one nearer the probe writes only a prompt's last rows that will still be in the span then."""
        drafting = self._drafts_now(seqs)
        if self.pause is None:
            return drafting, None
        if drafting and not self.cache.mtp_current([s.request.request_id for s in seqs]):
            drafting = False
        cap = self.cache.layout.swa_cap
        keep = cap if drafting else self.pause.keep_rows(cap)
        return drafting, (None if keep >= cap else keep)

    def _drafts_now(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether this MTP step's requests draft (``DraftPause``: not while drafting does not pay; a step that
        samples nothing proposes nothing and is not counted)."""
        return self.pause is None or not any(s.sample for s in seqs) or self.pause.drafts_now()

    def _record(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_stats.record(num_drafts, num_accepted)
        if self.pause is not None:
            self.pause.record(num_drafts, num_accepted)

    # ---- the overlap scheduler ----------------------------------------------------------------------
    @property
    def overlaps_steps(self) -> bool:
        """Whether steps overlap: the overlap scheduler on, a runner that takes inputs from the device (the
        multi-rank driver broadcasts them to its ranks), and with MTP a proposer whose drafts stay on the device
        (not on the multi-rank driver)."""
        return (self.overlap_scheduler and self.runner.supports_overlap
                and (self.draft_len == 0 or (self.proposer is not None and self.proposer.overlaps)))

    def _overlaps(self, seqs: list[ScheduledSeq]) -> bool:
        """Leave this step's tokens on the device (a step that samples nothing has none)."""
        return self.overlaps_steps and any(s.sample for s in seqs)

    def _whole_step(self, seqs: list[ScheduledSeq], plan, drafting: bool) -> bool:
        """Run the step as one CUDA graph (target pass, acceptance, the MTP drafts): an MTP step whose verdict
        stays on the device, every seq sampling greedily with the full draft length, a proposer whose drafts
        are the MTP layer's, a bucket with the graph. With drafting paused: every seq with no drafts, on a
        keep-up bucket (its graph: the target pass and the MTP layer's keep-up pass)."""
        k = self.draft_len if drafting else 0
        return (self.draft_len > 0 and self.proposer is not None and self.proposer.in_step_graph
                and self.runner.has_step_graph(plan, k)
                and (self._overlaps(seqs) or self._verifies_on_device(seqs))
                and all(s.sample and s.request.params.greedy and len(s.drafts) == k for s in seqs))

    def _verdict(self, seqs: list[ScheduledSeq], plan, target: TargetOutput) -> DeviceVerdict:
        """The step's acceptance on the device: computed with the step's graph, or now."""
        if target.step is not None:
            return verdict_of_step_graph(target.step, len(seqs))
        return accept_on_device(seqs, target.all_rows(), target.inputs, self._draw_positions(seqs, plan))

    def _draw_positions(self, seqs: list[ScheduledSeq], plan) -> torch.Tensor | None:
        """The sequence position of the token each logit row of the step draws (its step row's position + 1),
        on the device: from the host's C of each request, or, when an overlapped MTP step left some C on the
        device only (``plan.unsettled``), from the plan's positions there. None when every seq that samples
        is greedy."""
        if all(s.request.params.greedy for s in seqs if s.sample):
            return None
        if any(getattr(plan, "unsettled", ())):
            _, rows, _ = target_inputs(seqs)
            return plan.positions[to_device(rows, plan.rows.device)] + 1
        pos = []
        for s in seqs:
            if s.sample:  # its logit rows are its step's last len(drafts) + 1 rows, from row C on
                first = s.request.num_computed + s.num_new - len(s.drafts)
                pos += range(first, first + len(s.drafts) + 1)
        return to_device(pos, self.device)

    def _launch(self, seqs: list[ScheduledSeq], plan, target: TargetOutput) -> LaunchedStep:
        """The step's tokens, chosen on the device (greedy rows by argmax, sampled rows drawn keyed by their
        request and position, as the synchronous step draws them) and queued for the host, their logprobs
        behind them; each sampled request counts one pending token until ``_resolve`` reads it."""
        rows = target.all_rows()
        tokens = greedy_tokens(rows)
        row_of, asks, drawn = {}, [], []
        for s in seqs:
            if s.sample:
                r = row_of[s.request.request_id] = len(row_of)
                req = s.request
                if not req.params.greedy:
                    drawn.append((r, req))
                req.num_pending += 1
                asks.append(req.params.logprobs)
        if drawn:
            at = to_device([r for r, _ in drawn], rows.device)
            tokens[at] = sample_rows(rows[at], [q.params for _, q in drawn], [q.key for _, q in drawn],
                                     self._draw_positions(seqs, plan)[at])
        host = HostCopy(tokens)  # (queued first: read first)
        return LaunchedStep(seqs, tokens[:, None], row_of, host,
                            StepLogprobs.launch(rows, tokens, [1] * len(asks), asks))

    def _shift(self, seqs: list[ScheduledSeq], prev: LaunchedStep | None) -> torch.Tensor | None:
        """The committed rows each seq has beyond its host ``num_computed``, on the device: the drafts its
        request accepted in ``prev``, an overlapped MTP step not read back yet (None when no seq has any)."""
        if prev is None or prev.mtp is None or not any(s.request.unsettled for s in seqs):
            return None
        index = {s.request.request_id: b for b, s in enumerate(prev.seqs)}
        pairs = [(b, index[s.request.request_id]) for b, s in enumerate(seqs) if s.request.unsettled]
        if len(pairs) == len(seqs) and all(b == a for b, a in pairs):  # the same seqs in the same order
            return prev.mtp.verdict.accepted_drafts[:len(seqs)]
        t = to_device([b for b, _ in pairs] + [b for _, b in pairs], self.device)
        shift = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        shift[t[:len(pairs)]] = prev.mtp.verdict.accepted_drafts[t[len(pairs):]]
        return shift

    def _launch_mtp(self, seqs: list[ScheduledSeq], plan, target: TargetOutput, drafting: bool) -> LaunchedStep:
        """An MTP step left on the device: acceptance (``spec.accept_on_device``, the drafts read from the
        step's own inputs), the proposer's drafts from it (none while drafting is paused), and the next step's
        inputs (the token after the accepted drafts, then the new drafts), all queued for the host, which reads
        them in the next call."""
        rows = target.all_rows()
        verdict = self._verdict(seqs, plan, target)
        logprobs = StepLogprobs.launch(rows, verdict.target_ids, verdict.rows_per_seq,
                                       [s.request.params.logprobs for s in seqs])
        proposals = self.proposer.propose_on_device(seqs, plan, target, verdict,
                                                    [s.sample and drafting for s in seqs])
        sampled = [b for b, s in enumerate(seqs) if s.sample]
        bonus = verdict.last_ids
        drafts = proposals.drafts
        if drafts.active != (tuple(sampled) if drafting else ()):
            raise RuntimeError(f"the proposer drafted for seqs {drafts.active}, the step samples {sampled}"
                               f" ({'drafting' if drafting else 'drafting paused'})")
        inputs = torch.cat([bonus[:, None], drafts.tokens], 1) if drafts.tokens is not None else bonus[:, None]
        for b in sampled:
            req = seqs[b].request
            req.inflight = InFlight(plan.step_id, len(seqs[b].drafts), inputs.shape[1] - 1)
        return LaunchedStep(seqs, inputs, {seqs[b].request.request_id: r for r, b in enumerate(sampled)},
                            logprobs=logprobs, mtp=LaunchedMtp(plan, verdict, proposals,
                                                               tuple(s.request.num_preemptions for s in seqs)))

    def _resolve(self, step: LaunchedStep) -> tuple[list[ScheduledSeq], list[list[int]]]:
        """Read back an overlapped step's tokens (and logprobs) and append them (a request that ended
        meanwhile, by an abort or at an earlier stop token, drops its token)."""
        if step.mtp is not None:
            return self._resolve_mtp(step)
        toks = step.host.tolist()
        logprobs = step.logprobs.read() if step.logprobs is not None else [None] * len(toks)
        emitted = []
        for s in step.seqs:
            req, new = s.request, []
            if s.sample:
                req.num_pending -= 1
                r = step.row_of[req.request_id]
                if req.finish_reason is None:
                    new = req.append([toks[r]], logprobs[r])
            emitted.append(new)
        return step.seqs, emitted

    def _resolve_mtp(self, step: LaunchedStep) -> tuple[list[ScheduledSeq], list[list[int]]]:
        """Read back an overlapped MTP step: each request's emitted tokens (the host checks a greedy one's
        accepted count with ``accept_greedy`` on the same argmax and drafts), its accepted drafts settled in
        the cache, and the drafts its next step verifies. A request that ended meanwhile drops its tokens; one
        preempted meanwhile keeps them but no longer holds the rows (nothing to settle)."""
        m = step.mtp
        ids, kept, checked = m.verdict.read_all()
        row_logprobs = step.logprobs.read() if step.logprobs is not None else [None] * len(step.seqs)
        proposed = m.proposals.read()
        extras, emitted = {}, []
        for b, s in enumerate(step.seqs):
            req, new = s.request, []
            if s.sample:
                if req.inflight is not None and req.inflight.step_id == m.plan.step_id:
                    req.inflight = None  # (a later launched step of the request keeps its own)
                    if req.num_preemptions == m.epochs[b]:
                        req.drafts = proposed[b]  # (what its next step verifies, if that runs on the host)
                toks = self._verdict_tokens(s, ids[b], kept[b], checked[b])
                if not req.finished and req.finish_reason is None:
                    self._record(len(s.drafts), len(toks) - 1)
                    lp = row_logprobs[b]
                    new = req.append(toks, None if lp is None else lp[:len(toks)])
                    if req.num_preemptions == m.epochs[b] and s.drafts:  # (0 extra rows settle too)
                        extras[req.request_id] = len(toks) - 1
                        req.num_computed += len(toks) - 1
            emitted.append(new)
        self.cache.settle(m.plan, extras)
        return step.seqs, emitted

    def _run(self, seqs: list[ScheduledSeq], plan, target: TargetOutput, mtp: bool,
             drafting: bool) -> tuple[list[int], list[list[int]]]:
        """Verify/sample the target's logits, MTP proposal (``drafting``: drafts for the next step, else the MTP
        layer's catch-up pass only). Returns accepted counts and emitted tokens. A request that ended while this
        step ran (a stop token read back from the overlapped step before) emits nothing."""
        if mtp and self._verifies_on_device(seqs):
            return self._run_on_device(seqs, plan, target, drafting)
        greedy = self._greedy_ids([lg if s.sample and s.request.params.greedy else None
                                   for s, lg in zip(seqs, target.logits)], target)
        chosen: list[list[int] | None] = []  # per seq: the tokens it emits (None: none)
        for s, logits, ids in zip(seqs, target.logits, greedy):
            if not s.sample or s.request.finish_reason is not None:
                chosen.append(None)
            else:
                chosen.append(accept_greedy(ids, list(s.drafts)) if ids is not None
                              else self._verify_sampled(s, logits))
        logprobs = self._logprobs_of(seqs, target, chosen)
        accepted, emitted = [], []
        for s, toks, lp in zip(seqs, chosen, logprobs):
            if toks is None:
                accepted.append(s.num_new)
                emitted.append([])
                continue
            self._accept(s, toks, lp, accepted, emitted)

        if mtp:
            drafts = [drafting and s.sample and s.request.finish_reason is None for s in seqs]
            self._adopt(seqs, self.proposer.propose(seqs, plan, target, accepted, drafts))
        return accepted, emitted

    def _verifies_on_device(self, seqs: list[ScheduledSeq]) -> bool:
        """Acceptance on the device, drafts launched before the host reads it: a proposer (and runner) that
        takes it, and every seq that samples still live."""
        return (self.proposer.drafts_from_device and any(s.sample for s in seqs)
                and all(s.request.finish_reason is None for s in seqs if s.sample))

    def _run_on_device(self, seqs: list[ScheduledSeq], plan, target: TargetOutput, drafting: bool):
        """The MTP step with one host read: acceptance on the device (against the argmax, or each sampled
        request's keyed draws), the proposer's passes launched from it, then the emitted tokens and accepted
        counts read back (queued before the passes, so the read waits for nothing more than the drafts' own
        read did). The host checks a greedy seq's count against ``accept_greedy`` on the same argmax."""
        rows = target.all_rows()
        verdict = self._verdict(seqs, plan, target)
        # the logprobs of every verify row's argmax, queued before the drafts; the accepted rows' are kept
        logprobs = StepLogprobs.launch(rows, verdict.target_ids, verdict.rows_per_seq,
                                       [s.request.params.logprobs for s in seqs])
        proposals = self.proposer.propose(seqs, plan, target, verdict, [s.sample and drafting for s in seqs])
        ids, kept, checked = verdict.read_all()
        row_logprobs = logprobs.read() if logprobs is not None else [None] * len(seqs)
        accepted, emitted = [], []
        for s, tgt, n, drafts, lp in zip(seqs, ids, kept, checked, row_logprobs):
            if not s.sample:
                accepted.append(s.num_new)
                emitted.append([])
                continue
            toks = self._verdict_tokens(s, tgt, n, drafts)
            self._accept(s, toks, None if lp is None else lp[:len(toks)], accepted, emitted)
        self._adopt(seqs, proposals)
        return accepted, emitted

    @staticmethod
    def _verdict_tokens(s: ScheduledSeq, target: list[int], kept: int, drafts: list[int]) -> list[int]:
        """The tokens a seq emits from a device verdict read back: ``target`` its rows of the verdict's
        target ids, ``kept`` its accepted rows, ``drafts`` the drafts the device verified. A greedy seq's are
        recomputed by ``accept_greedy`` and must keep as many rows as the device did; a sampled seq's are the
        device's (its accepted drafts, then the drawn token)."""
        fixed = s.num_new - len(s.drafts)  # rows kept whatever the verdict
        if not s.request.params.greedy:
            return target[:kept - fixed + 1]
        toks = accept_greedy(target, drafts)
        if fixed + len(toks) - 1 != kept:
            raise RuntimeError(f"request {s.request.request_id!r}: acceptance on the device kept {kept} rows, the"
                               f" host's {fixed + len(toks) - 1} (drafts {drafts}, target {target})")
        return toks

    def _accept(self, s: ScheduledSeq, toks: list[int], logprobs: list[dict] | None, accepted: list[int],
                emitted: list[list[int]]) -> None:
        """Record a verified seq: ``toks`` its accepted drafts plus the target's token after them (``logprobs``
        theirs, when the request asks)."""
        self._record(len(s.drafts), len(toks) - 1)
        accepted.append(s.num_new - len(s.drafts) + len(toks) - 1)
        emitted.append(s.request.append(toks, logprobs))

    @staticmethod
    def _logprobs_of(seqs: list[ScheduledSeq], target: TargetOutput,
                     chosen: list[list[int] | None]) -> list[list[dict] | None]:
        """The logprobs of the tokens each seq emits (``chosen``: the target's tokens at its first verify
        rows), for the seqs that ask (None for the others); nothing is computed when none asks."""
        asks = [toks is not None and s.request.params.logprobs is not None for s, toks in zip(seqs, chosen)]
        if not any(asks):
            return [None] * len(seqs)
        blocks = [lg[:len(toks)] for lg, toks, a in zip(target.logits, chosen, asks) if a]
        tokens = [t for toks, a in zip(chosen, asks) if a for t in toks]
        rows_per_seq = [len(toks) if a else 0 for toks, a in zip(chosen, asks)]
        top_n = [s.request.params.logprobs if a else None for s, a in zip(seqs, asks)]
        return StepLogprobs.launch(torch.cat(blocks), tokens, rows_per_seq, top_n).read()

    def _adopt(self, seqs: list[ScheduledSeq], proposals) -> None:
        """The proposals become the drafts of the requests still running (after this step's tokens); one
        without a proposal (drafting paused) verifies none next."""
        for s, p in zip(seqs, proposals):
            if s.request.finish_reason is None:
                s.request.drafts = self.proposer.drafts(s.request, p) if p is not None else []

    @staticmethod
    def _greedy_ids(logits: list[torch.Tensor | None], target: TargetOutput) -> list[list[int] | None]:
        """The argmax of every given [rows, V] block, in one device op and one host sync for the batch: over
        all of the step's logit rows (``TargetOutput.all_rows``); the rows of non-greedy seqs are computed and
        dropped."""
        if all(lg is None for lg in logits):
            return [None] * len(logits)
        flat = greedy_tokens(target.all_rows()).tolist()
        out, off = [], 0
        for lg, blk in zip(logits, target.logits):
            n = 0 if blk is None else blk.shape[0]
            out.append(None if lg is None else flat[off:off + n])
            off += n
        return out

    def _verify_sampled(self, s: ScheduledSeq, logits: torch.Tensor) -> list[int]:
        """The host's verify of a sampled seq (settled: its position is the request's length)."""
        req = s.request
        return accept_sampled(logits, list(s.drafts), req.params, req.key, req.num_tokens)

    def _output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer is not None and req.params.detokenize else None
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_ids), prompt=req.prompt,
            outputs=[CompletionOutput(0, list(req.output_ids), text, req.finish_reason,
                                      None if req.logprobs is None else list(req.logprobs))],
            finished=req.finished,
            metrics={"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time,
                     "first_token_time": req.first_token_time, "finish_time": req.finish_time,
                     "num_preemptions": req.num_preemptions})

    def reset_stats(self):
        """Start the step, preemption and speculation counters afresh (after warmup, or between runs)."""
        self.spec_stats = SpecStats()
        if self.pause is not None:
            self.pause.reset()
        self.num_steps = 0
        self.scheduler.reset_stats()

    def get_stats(self) -> dict:
        """Counters since the last ``reset_stats``, and the live state: requests running (in the batch) and
        waiting (queued or preempted), the KV cache's blocks and request slots in use."""
        statuses = [r.status for r in self.requests.values()]
        cache = self.cache
        return {"num_steps": self.num_steps, "num_preemptions": self.scheduler.num_preemptions,
                "speculative": ({**self.spec_stats.as_dict(),
                                 "pause": None if self.pause is None else self.pause.as_dict()}
                                if self.draft_len else None),
                "num_running": statuses.count(Status.RUNNING), "num_waiting": statuses.count(Status.WAITING),
                "kv_cache_usage": {"num_blocks": cache.num_blocks,
                                   "used_blocks": cache.num_blocks - cache.num_free_blocks,
                                   "num_slots": cache.num_slots,
                                   "used_slots": cache.num_slots - cache.num_free_slots}}
