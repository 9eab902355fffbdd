"""Cache bookkeeping in plain Python (no torch state): slots, blocks, committed lengths, the active plan.

One manager holds the state of every layer of a request, the MTP layer included (R1):

* a **slot** (1..num_slots) per live request: its SWA ring in every SWA layer (main layers and the MTP
  layer) and its compressor-state rings; fixed size, taken by ``admit`` and given back by ``free``;
* **blocks** (1..num_blocks) of ``tokens_per_block`` tokens for the growing state (compressed entries and
  indexer keys); block j of a request covers positions [j*tpb, (j+1)*tpb). ``reserve`` extends a request's
  block table all-or-nothing, including the lookahead for draft tokens before they are scheduled (R5).
  Blocks are only returned by ``free``: a rollback keeps them (they cover lookahead the next verify needs).

Slot 0 and block 0 are the null slot/block: never handed out, padded rows point at them (R3).

A step: ``plan = begin_step(seqs)`` -> forward with ``plan`` -> ``commit_step(plan, num_accepted)``.
``begin_step`` refuses to start while another plan is active, ``commit_step`` refuses any plan but the
active one (StalePlanError), and ``abort_step`` abandons the active step by freeing its requests (their
rings may hold writes of a step that was never committed). "Cannot fit" is an ``Alloc`` value, never an
exception; programming errors (unknown request, missing reservation) raise with a message naming the call
that was missing.

Overlapped MTP steps (the engine launches step N+1 before it reads step N's acceptance): ``commit_step(plan,
lower, unsettled=...)`` commits the rows every outcome keeps (``lower``) and leaves up to ``unsettled[b]`` more
unsettled; ``settle(plan, extras)`` adds them once the host has read them. Meanwhile a request's committed
length is known on the device only: ``begin_step(..., shift=...)`` takes it as a device tensor, and its
reservation covers the largest length the step can settle to (R5 for the worst case). A request freed before
its step settles takes its unsettled rows with it.

Set the environment variable ``DSV4_CHECK_CACHE=1`` to run ``check_integrity()`` after every
``commit_step``, ``free`` and ``abort_step`` (R6; the tests keep it on).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from dsv4 import env
from dsv4.cache.layout import CacheLayout
from dsv4.cache.plan import StepPlan, build_plan

CHECK_ENV = env.CHECK_CACHE
_manager_ids = itertools.count(1)


class StalePlanError(RuntimeError):
    """A StepPlan used after its step was committed, or with a manager that did not build it."""


class StepOrderError(RuntimeError):
    """A manager call out of order (e.g. begin_step while a plan is active); the message names the fix."""


class CacheIntegrityError(RuntimeError):
    """An invariant of the cache bookkeeping does not hold (R6); the message describes the violation."""


@dataclass(frozen=True)
class Alloc:
    """Answer of admit / reserve: ``ok`` or not, and why not (for the scheduler's log)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


OK = Alloc(True)


@dataclass(frozen=True)
class SeqStep:
    """One request's part of a step: ``num_new`` tokens at positions C..C+num_new-1, then ``draft_len``
    MTP draft steps (0 = no drafting for this request)."""

    req_id: Hashable
    num_new: int
    draft_len: int = 0


@dataclass
class _Req:
    slot: int
    blocks: list = field(default_factory=list)
    num_computed: int = 0  # committed rows the host knows (a lower bound while ``unsettled`` holds any)
    unsettled: dict = field(default_factory=dict)  # step id -> the most rows that step may still commit
    # rows below this position may be stale in the MTP layer's window ring (steps that left its keep-up out)
    mtp_stale_to: int = 0

    @property
    def max_computed(self) -> int:
        return self.num_computed + sum(self.unsettled.values())


class KVCacheManager:
    def __init__(self, layout: CacheLayout, num_slots: int, num_blocks: int):
        if num_slots < 1 or num_blocks < 0:
            raise ValueError(f"num_slots must be >= 1 and num_blocks >= 0, got {num_slots}, {num_blocks}")
        self.layout = layout
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.uid = next(_manager_ids)
        # free lists are stacks popped from the end: lowest ids are handed out first
        self._free_slots = list(range(num_slots, 0, -1))
        self._free_blocks = list(range(num_blocks, 0, -1))
        self._reqs: dict = {}
        self._step_id = 0
        self._active: StepPlan | None = None

    # ---- queries ------------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def step_id(self) -> int:
        """Id the next plan gets (incremented by every commit_step)."""
        return self._step_id

    @property
    def active_plan(self) -> StepPlan | None:
        return self._active

    def has(self, req_id) -> bool:
        return req_id in self._reqs

    def num_computed(self, req_id) -> int:
        """Committed rows (a lower bound while a step of the request is unsettled: ``num_unsettled``)."""
        return self._get(req_id, "num_computed").num_computed

    def num_unsettled(self, req_id) -> int:
        """The most rows the request's unsettled steps may still commit (0: its length is known)."""
        return sum(self._get(req_id, "num_unsettled").unsettled.values())

    def num_reserved_tokens(self, req_id) -> int:
        return len(self._get(req_id, "num_reserved_tokens").blocks) * self.layout.tokens_per_block

    def slot_of(self, req_id) -> int:
        return self._get(req_id, "slot_of").slot

    def block_table(self, req_id) -> tuple[int, ...]:
        return tuple(self._get(req_id, "block_table").blocks)

    def _get(self, req_id, what: str) -> _Req:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise KeyError(f"{what}({req_id!r}): request is not admitted (call admit({req_id!r}) first, "
                           "or it was freed)") from None

    # ---- allocation ---------------------------------------------------------------------------------
    def admit(self, req_id) -> Alloc:
        """Take a free slot for a new request (no blocks yet; ``reserve`` gives those)."""
        if req_id in self._reqs:
            raise ValueError(f"admit({req_id!r}): request is already admitted")
        if not self._free_slots:
            return Alloc(False, f"no free slot ({self.num_slots} slots, all in use)")
        self._reqs[req_id] = _Req(slot=self._free_slots.pop())
        return OK

    def _blocks_needed(self, req: _Req, num_tokens: int) -> int:
        return max(0, self.layout.num_blocks_for(num_tokens) - len(req.blocks))

    def can_reserve(self, req_id, num_tokens: int) -> bool:
        return self._blocks_needed(self._get(req_id, "can_reserve"), num_tokens) <= len(self._free_blocks)

    def reserve(self, req_id, num_tokens: int) -> Alloc:
        """Make the request's block table cover positions [0, num_tokens); all or nothing, never shrinks."""
        req = self._get(req_id, "reserve")
        if num_tokens < 0:
            raise ValueError(f"reserve({req_id!r}, {num_tokens}): num_tokens must be >= 0")
        need = self._blocks_needed(req, num_tokens)
        if need > len(self._free_blocks):
            return Alloc(False, f"{req_id!r} needs {need} more blocks for {num_tokens} tokens, "
                                f"{len(self._free_blocks)} free")
        for _ in range(need):
            req.blocks.append(self._free_blocks.pop())
        return OK

    def free(self, req_id) -> None:
        """Return the request's slot and all its blocks. Refused while the request is in the active step."""
        req = self._get(req_id, "free")
        if self._active is not None and req_id in self._active.req_ids:
            raise StepOrderError(
                f"free({req_id!r}): the request is part of active step {self._active.step_id}; call "
                "commit_step(plan, num_accepted) first, or abort_step(plan) to abandon the step")
        self._release(req_id, req)
        self._maybe_check()

    def _release(self, req_id, req: _Req) -> None:
        del self._reqs[req_id]
        self._free_blocks.extend(reversed(req.blocks))
        self._free_slots.append(req.slot)

    # ---- steps ----------------------------------------------------------------------------------------
    def begin_step(self, seqs: Sequence[SeqStep], *, pad_tokens_to: int | None = None,
                   pad_batch_to: int | None = None, max_entries: int | None = None,
                   max_blocks: int | None = None, device="cpu", shift=None, mtp_keep_up: bool = True,
                   mtp_keep_last: int | None = None) -> StepPlan:
        """Build the StepPlan of one step and make it the active plan (see plan.py for its tables).

        Every request must be admitted and have reserved C + num_new tokens (C at its largest, for a request
        with unsettled rows). Padding arguments give fixed shapes for CUDA graphs: pad_tokens_to (N),
        pad_batch_to (B), max_entries (E of entry_rows), max_blocks (width of block_table). ``shift``: a
        device tensor [len(seqs)], each request's committed rows beyond ``num_computed`` (0 .. its
        ``num_unsettled``), needed when any request of the step has unsettled rows. ``mtp_keep_up`` False: the
        step leaves the MTP layer's window rows of its rows unwritten (``mtp_current``); ``mtp_keep_last``: it
        writes at most each request's last this many (None: all it keeps), and leaves the earlier ones stale.
        """
        if mtp_keep_last is not None and mtp_keep_last < 1:
            raise ValueError(f"begin_step: mtp_keep_last {mtp_keep_last}: at least 1 row (mtp_keep_up=False for none)")
        if self._active is not None:
            raise StepOrderError(f"begin_step: step {self._active.step_id} is still active; call "
                                 "commit_step(plan, num_accepted) (or abort_step(plan)) before the next step")
        if not seqs:
            raise ValueError("begin_step: empty batch")
        ids = [s.req_id for s in seqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"begin_step: a request appears twice in the batch {ids}")
        maxd = self.layout.max_draft_len
        reqs = []
        for s in seqs:
            req = self._reqs.get(s.req_id)
            if req is None:
                raise KeyError(f"begin_step: request {s.req_id!r} is not admitted; call admit({s.req_id!r}) "
                               f"and reserve({s.req_id!r}, num_tokens) first")
            if s.num_new < 1:
                raise ValueError(f"begin_step: request {s.req_id!r} has num_new={s.num_new}; need >= 1")
            if not 0 <= s.draft_len <= maxd:
                raise ValueError(f"begin_step: request {s.req_id!r} asks for draft_len={s.draft_len} but the "
                                 f"cache was sized for max_draft_len={maxd}; build the cache with a larger "
                                 "max_draft_len or draft less")
            end = req.max_computed + s.num_new
            have = len(req.blocks) * self.layout.tokens_per_block
            if end > have:
                raise ValueError(f"begin_step: request {s.req_id!r} schedules positions up to {end - 1} but has"
                                 f" reserved {have} tokens; call reserve({s.req_id!r}, {end}) (plus draft"
                                 " lookahead) before scheduling it")
            reqs.append(req)
        unsettled = [r.max_computed - r.num_computed for r in reqs]
        if any(unsettled) and shift is None:
            rid = next(s.req_id for s, u in zip(seqs, unsettled) if u)
            raise StepOrderError(f"begin_step: request {rid!r} has unsettled rows of an overlapped step; pass"
                                 " shift= (its accepted rows on the device), or settle(plan, extras) first")
        plan = build_plan(
            self.layout, num_slots=self.num_slots, owner=self.uid, step_id=self._step_id, req_ids=tuple(ids),
            num_computed=tuple(r.num_computed for r in reqs), num_new=tuple(s.num_new for s in seqs),
            draft_lens=tuple(s.draft_len for s in seqs), slots=tuple(r.slot for r in reqs),
            block_tables=[tuple(r.blocks) for r in reqs], pad_tokens_to=pad_tokens_to,
            pad_batch_to=pad_batch_to, max_entries=max_entries, max_blocks=max_blocks, device=device,
            unsettled=unsettled, shift=shift if any(unsettled) else None, mtp_keep_up=mtp_keep_up,
            mtp_keep_last=mtp_keep_last)
        if not mtp_keep_up or mtp_keep_last is not None:
            kept = 0 if not mtp_keep_up else mtp_keep_last
            for r, s in zip(reqs, seqs):
                if s.num_new > kept:
                    r.mtp_stale_to = max(r.mtp_stale_to, r.max_computed + s.num_new - kept)
        self._active = plan
        return plan

    def mtp_current(self, req_ids) -> bool:
        """Whether every one of these requests may run a drafting MTP pass now: no row of its MTP window ring's
        span (``swa_cap`` positions before its committed length) was left stale by a step without the keep-up
        pass. A request admitted since (a new one, a preempted one back) starts current."""
        cap = self.layout.swa_cap
        reqs = (self._get(r, "mtp_current") for r in req_ids)
        return all(q.mtp_stale_to <= max(0, q.num_computed - cap) for q in reqs)

    def check_plan(self, plan: StepPlan) -> None:
        """Raise StalePlanError unless ``plan`` is this manager's active plan."""
        if plan.owner != self.uid:
            raise StalePlanError(f"StepPlan of step {plan.step_id} was built by cache manager #{plan.owner}, "
                                 f"not by this one (#{self.uid}); use the plan of this manager's begin_step()")
        if self._active is not plan:
            now = (f"the active plan is step {self._active.step_id}" if self._active is not None
                   else f"no plan is active (next step {self._step_id})")
            raise StalePlanError(f"StepPlan of step {plan.step_id} is stale: {now}; "
                                 "a plan is valid for one step only, build a new one with begin_step()")

    def commit_step(self, plan: StepPlan, num_accepted: Sequence[int],
                    unsettled: Sequence[int] | None = None) -> None:
        """Raise each request's committed length by its accepted count a (1 <= a <= num_new).

        a < num_new rolls back the rest: only the committed length drops, nothing is rewritten (R4). At most
        max_draft_len tokens of a request may be rejected; the rings have only that much headroom.
        ``unsettled[b]``: up to that many more of request b's rows may be accepted, which only the device
        knows yet (an overlapped MTP step): a is then the rows every outcome keeps, and ``settle`` adds the
        rest. The request's reservation already covers them (``begin_step`` checked C + num_new).
        """
        self.check_plan(plan)
        acc = [int(a) for a in num_accepted]
        more = [0] * len(acc) if unsettled is None else [int(u) for u in unsettled]
        if len(acc) != plan.num_seqs or len(more) != plan.num_seqs:
            raise ValueError(f"commit_step: {len(acc)} accepted counts and {len(more)} unsettled counts for"
                             f" {plan.num_seqs} requests")
        maxd = self.layout.max_draft_len
        for rid, n, a, u in zip(plan.req_ids, plan.num_new, acc, more):
            if not 1 <= a <= n or not 0 <= u <= n - a:
                raise ValueError(f"commit_step: request {rid!r} accepted {a} of {n} tokens (+ up to {u}"
                                 f" unsettled); need 1 <= a <= a + unsettled <= {n}")
            if n - a > maxd:
                raise ValueError(f"commit_step: request {rid!r} rejects {n - a} of {n} tokens, more than "
                                 f"max_draft_len={maxd}; the rings keep only max_draft_len rows of headroom")
        for rid, a, u in zip(plan.req_ids, acc, more):
            req = self._reqs[rid]
            req.num_computed += a
            if u:
                req.unsettled[plan.step_id] = u
        self._step_id += 1
        self._active = None
        self._maybe_check()

    def settle(self, plan: StepPlan, extras: dict) -> None:
        """Commit the rows a committed step left unsettled: ``extras`` maps a request of ``plan`` to the rows
        its step accepted beyond those ``commit_step`` took (0 .. its unsettled count). A request freed since
        (finished, aborted, preempted) is left out by the caller; one that lacks the step's unsettled rows
        is an error."""
        if plan.owner != self.uid:
            raise StalePlanError(f"settle: the plan of step {plan.step_id} was built by cache manager"
                                 f" #{plan.owner}, not by this one (#{self.uid})")
        for rid, extra in extras.items():
            req = self._get(rid, "settle")
            most = req.unsettled.get(plan.step_id)
            if most is None:
                raise StepOrderError(f"settle: request {rid!r} has no unsettled rows of step {plan.step_id}"
                                     f" (unsettled: {req.unsettled}); commit_step(plan, ..., unsettled=) first")
            if not 0 <= int(extra) <= most:
                raise ValueError(f"settle: request {rid!r} accepted {extra} more rows of step {plan.step_id};"
                                 f" need 0 <= extra <= {most}")
            del req.unsettled[plan.step_id]
            req.num_computed += int(extra)
        self._maybe_check()

    def abort_step(self, plan: StepPlan) -> None:
        """Abandon the active step (e.g. its forward failed): free every request in it.

        Its requests cannot continue: the step may have written ring rows beyond what a rollback can
        absorb, so they must be re-admitted and recomputed.
        """
        self.check_plan(plan)
        for rid in plan.req_ids:
            self._release(rid, self._reqs[rid])
        self._step_id += 1
        self._active = None
        self._maybe_check()

    # ---- integrity (R6) -------------------------------------------------------------------------------
    def _maybe_check(self) -> None:
        if env.flag(CHECK_ENV):
            self.check_integrity()

    def check_integrity(self) -> None:
        """Raise CacheIntegrityError if any bookkeeping invariant is violated."""
        errors = []
        tpb, maxd = self.layout.tokens_per_block, self.layout.max_draft_len

        def owned_once(kind, free, total, owners):
            if len(set(free)) != len(free):
                errors.append(f"a {kind} is on the free list twice")
            seen = {}
            for rid, ids in owners:
                for i in ids:
                    if i == 0:
                        errors.append(f"request {rid!r} owns the null {kind} 0")
                    elif not 1 <= i <= total:
                        errors.append(f"request {rid!r} owns {kind} {i}, outside 1..{total}")
                    elif i in seen:
                        errors.append(f"{kind} {i} is owned by {seen[i]!r} and {rid!r}")
                    seen[i] = rid
            free_set = set(free)
            if 0 in free_set:
                errors.append(f"the null {kind} 0 is on the free list")
            both = free_set & set(seen)
            if both:
                errors.append(f"{kind}(s) {sorted(both)[:8]} are both free and owned")
            if any(not 1 <= i <= total for i in free_set - {0}):
                errors.append(f"the free {kind} list holds ids outside 1..{total}")
            if len(free) + len(seen) != total:
                errors.append(f"{kind}s: {len(free)} free + {len(seen)} owned != {total} total")

        owned_once("slot", self._free_slots, self.num_slots, [(r, [q.slot]) for r, q in self._reqs.items()])
        owned_once("block", self._free_blocks, self.num_blocks, [(r, q.blocks) for r, q in self._reqs.items()])
        for rid, q in self._reqs.items():
            if q.num_computed < 0 or q.max_computed > len(q.blocks) * tpb:
                errors.append(f"request {rid!r}: committed length {q.num_computed} outside reserved "
                              f"0..{len(q.blocks) * tpb} (up to {q.max_computed} once settled)")
            if not 0 <= q.mtp_stale_to <= len(q.blocks) * tpb:
                errors.append(f"request {rid!r}: MTP ring rows marked stale up to position {q.mtp_stale_to},"
                              f" outside its 0..{len(q.blocks) * tpb} reserved tokens")
            if any(s >= self._step_id or not 0 < u <= maxd for s, u in q.unsettled.items()):
                errors.append(f"request {rid!r}: unsettled rows {q.unsettled} name a step not committed yet or"
                              f" a count outside 1..max_draft_len={maxd}")
        if self._active is not None:
            p = self._active
            if p.owner != self.uid or p.step_id != self._step_id:
                errors.append(f"active plan (manager #{p.owner}, step {p.step_id}) does not belong to this "
                              f"manager's current step (#{self.uid}, step {self._step_id})")
            for rid, c, n, d, u in zip(p.req_ids, p.num_computed, p.num_new, p.draft_lens, p.unsettled):
                q = self._reqs.get(rid)
                if q is None:
                    errors.append(f"active plan names request {rid!r}, which is not admitted")
                    continue
                if q.num_computed != c or q.max_computed - q.num_computed != u:
                    errors.append(f"request {rid!r}: committed length {q.num_computed} (+{q.max_computed - c}"
                                  f" unsettled) changed under the active plan (built with {c} + {u})")
                if c + u + n > len(q.blocks) * tpb:
                    errors.append(f"request {rid!r}: active plan reaches position {c + u + n - 1} beyond its "
                                  f"{len(q.blocks) * tpb} reserved tokens")
                if not 0 <= d <= maxd:
                    errors.append(f"request {rid!r}: draft_len {d} outside 0..{maxd}")
        if errors:
            raise CacheIntegrityError("KV cache integrity check failed:\n  " + "\n  ".join(errors))
