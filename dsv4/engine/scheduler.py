"""Continuous batching with chunked prefill and preemption by recompute.

Each step: running requests first (decode / verify needs 1 + k tokens; an unfinished prefill continues
with its next chunk), then waiting requests are admitted while the token budget (``max_num_tokens``) and
the batch size (``max_batch_size``) allow. Before a request is scheduled the cache reserves every token
the step will write (its drafts included, R5). When the cache cannot fit a running request, the most
recently admitted other request is preempted (its cache freed at once, its tokens recomputed later); a
request is never dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..cache.manager import KVCacheManager
from .request import PENDING, Request, Status


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    token_ids: tuple[int, ...]  # inputs at positions num_computed .. num_computed + len - 1 (drafts included)
    sample: bool  # the step ends at the request's newest token: sample (or verify) there
    drafts: tuple[int, ...]  # drafts being verified (the tail of token_ids)

    @property
    def num_new(self) -> int:
        return len(self.token_ids)


class Scheduler:
    def __init__(self, cache: KVCacheManager, max_batch_size: int, max_num_tokens: int, prefill_alone: bool = False):
        """``prefill_alone`` (batch invariance): a step holds one request's prefill chunk and nothing else, or
        decode / verify rows only, so a prompt is chunked and computed the same whatever else is running, and a
        decode row never shares a step with a prefill chunk (which would take it off the decode kernels)."""
        self.cache = cache
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens
        self.prefill_alone = prefill_alone
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request):
        self.waiting.append(req)

    def reset_stats(self) -> None:
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request):
        """Release everything a finished or aborted request holds, at once."""
        if req in self.running:
            self.running.remove(req)
            self.cache.free(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def forget(self, req: Request):
        """Drop a request whose cache rows the cache already released (an aborted step)."""
        if req in self.running:
            self.running.remove(req)
        req.status = Status.FINISHED

    def _preempt(self, victim: Request):
        self.running.remove(victim)
        self.cache.free(victim.request_id)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _plan_tokens(self, req: Request, budget: int) -> ScheduledSeq | None:
        if req.awaiting_finish:  # its last token is on the device: nothing more to compute
            return None
        if req.inflight is not None:  # verify the in-flight MTP step's bonus token and drafts (on the device)
            ids = (PENDING,) * (1 + req.inflight.proposed)
            return ScheduledSeq(req, ids, True, ids[1:]) if len(ids) <= budget else None
        C, L = req.num_computed, req.num_tokens
        if C == L - 1:  # decode, verifying any pending drafts
            ids = (req.token_at(C),) + tuple(req.drafts)
            if len(ids) > budget:
                return None
            return ScheduledSeq(req, ids, True, tuple(req.drafts))
        n = min(L - C, budget)
        if n <= 0:
            return None
        return ScheduledSeq(req, req.token_range(C, C + n), C + n == L, ())

    def schedule(self) -> list[ScheduledSeq]:
        if not self.prefill_alone:
            out, budget = self._continue(list(self.running), self.max_num_tokens)
            return self._admit(out, budget, self.max_batch_size)
        prefilling = [r for r in self.running if not r.in_decode and not r.awaiting_finish]
        if prefilling:  # its next chunk, alone
            return self._continue(prefilling[:1], self.max_num_tokens)[0]
        out = self._admit([], self.max_num_tokens, len(self.running) + 1) if self.waiting else []
        return out or self._continue(list(self.running), self.max_num_tokens)[0]  # decode rows only

    def _continue(self, running: list[Request], budget: int) -> tuple[list[ScheduledSeq], int]:
        """The next tokens of running requests (decode / verify, or a prefill's next chunk), preempting the most
        recently admitted others when the cache cannot fit one; and the budget left."""
        out: list[ScheduledSeq] = []
        for req in running:
            if req not in self.running:  # preempted below while making room for an earlier one
                continue
            seq = self._plan_tokens(req, budget)
            if seq is None:
                continue
            need = req.num_computed + req.unsettled + seq.num_new  # (its largest C, while unsettled)
            while not self.cache.can_reserve(req.request_id, need):
                victims = [r for r in self.running if r is not req and r not in [s.request for s in out]]
                if not victims:
                    break
                self._preempt(victims[-1])
            if not self.cache.reserve(req.request_id, need).ok:
                if not out and len(self.running) == 1:
                    raise RuntimeError(f"request {req.request_id!r} cannot fit in the KV cache even alone"
                                       f" ({need} tokens); give the cache more memory or lower max_seq_len")
                self._preempt(req)
                continue
            out.append(seq)
            budget -= seq.num_new
        return out, budget

    def _admit(self, out: list[ScheduledSeq], budget: int, max_running: int) -> list[ScheduledSeq]:
        """Waiting requests join while the token budget and ``max_running`` allow."""
        while self.waiting and budget > 0 and len(self.running) < min(max_running, self.max_batch_size):
            req = self.waiting[0]
            if req.awaiting_finish or req.inflight is not None:  # preempted while its last tokens were on
                break  # the device: it waits for them (read back in this step); nothing overtakes it meanwhile
            if not self.cache.admit(req.request_id).ok:
                break
            seq = self._plan_tokens(req, budget)
            need = req.num_computed + seq.num_new
            if not self.cache.reserve(req.request_id, need).ok:
                self.cache.free(req.request_id)
                if not self.running:
                    raise RuntimeError(f"request {req.request_id!r} cannot fit in the KV cache even alone"
                                       f" ({need} tokens); give the cache more memory or lower max_seq_len")
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:  # (not again when a preempted request comes back)
                req.first_scheduled_time = time.perf_counter()
            self.running.append(req)
            out.append(seq)
            budget -= seq.num_new
        return out
