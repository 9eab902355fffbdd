"""A request's engine-side state. The KV cache holds its rows; this holds its tokens and sampling state.

Token regions of a running request (C = ``num_computed``, positions whose cache rows are committed)::

    tokens:  [ prompt ............ | outputs ....... ]           drafts (pending verification)
    pos:     0                    P                 len-1        len .. len+k-1
             |<------ computed: 0..C-1 ------>|<-- to compute -->|
    prefill: C < len-1  -> the step computes a chunk tokens[C : C+n]; the last chunk (C+n == len) samples
    decode:  C == len-1 -> the step computes tokens[len-1] and the k drafts (a verify when k > 0)

With the overlap scheduler a request's newest token may still be on the device (``num_pending``): it counts
in ``num_tokens`` and reads as ``PENDING`` until the engine has read it back; the runner takes its value
from the device output of the step that sampled it.

An overlapped MTP step leaves more on the device (``inflight``): how many tokens it emits (1 .. drafts it
verified + 1), which of its rows stay in the cache, and the drafts it proposed. None of them counts in
``num_tokens`` and ``num_computed`` is the rows every outcome keeps, until the engine reads the step back; the
next step verifies the device's tokens (its inputs all ``PENDING``: the token after the accepted drafts, then
the new drafts) at positions the device knows.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams

PENDING = -1  # the id of a token sampled on the device and not read back yet


@dataclass(frozen=True)
class InFlight:
    """An overlapped MTP step of the request, not read back yet."""

    step_id: int  # the step's cache plan
    verified: int  # drafts it verifies: it emits 1 .. verified + 1 tokens, and as many of its rows stay unsettled
    proposed: int  # drafts it proposes for the next step (on the device)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    key: int = 0  # the request's sampling key (sampler.request_key: its seed folded to 32 bits, or random)
    eos_token_id: int | None = None
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None  # when a step first computed some of it (set by the scheduler)
    first_token_time: float | None = None
    finish_time: float | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # mirror of the cache's committed length, reset on preemption
    drafts: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_pending: int = 0  # sampled tokens still on the device (overlap scheduler), after output_ids
    inflight: InFlight | None = None  # an overlapped MTP step not read back yet (see the module doc)
    # with params.logprobs: one dict per output token (token id -> logprob), kept aligned with output_ids
    logprobs: list[dict[int, float]] | None = None

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def tokens(self) -> list[int]:
        """Prompt + outputs as one new list (O(length): the per-step paths use ``token_at`` / ``token_range``)."""
        return self.prompt_ids + self.output_ids

    def token_at(self, p: int) -> int:
        P = len(self.prompt_ids)
        if p < P:
            return self.prompt_ids[p]
        return self.output_ids[p - P] if p - P < len(self.output_ids) else PENDING

    def token_range(self, start: int, stop: int) -> tuple[int, ...]:
        """tokens[start:stop] without building the whole sequence (pending tokens read as PENDING)."""
        P, K = len(self.prompt_ids), len(self.prompt_ids) + len(self.output_ids)
        known = stop if stop <= K else K
        if known <= P:
            out = tuple(self.prompt_ids[start:known])
        elif start >= P:
            out = tuple(self.output_ids[start - P:known - P])
        else:
            out = tuple(self.prompt_ids[start:]) + tuple(self.output_ids[:known - P])
        return out + (PENDING,) * (stop - max(known, start))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def most_pending(self) -> int:
        """The most tokens on the device, not read back yet (an overlapped step's, with or without MTP)."""
        return self.num_pending + (self.inflight.verified + 1 if self.inflight is not None else 0)

    @property
    def unsettled(self) -> int:
        """Rows of the in-flight MTP step that may yet stay in the cache beyond ``num_computed``."""
        return self.inflight.verified if self.inflight is not None else 0

    @property
    def awaiting_finish(self) -> bool:
        """Its pending tokens may reach max_tokens: it computes nothing more until they are read back (and
        ends then, if they do)."""
        pending = self.most_pending
        return pending > 0 and len(self.output_ids) + pending >= self.params.max_tokens

    @property
    def in_decode(self) -> bool:
        return self.inflight is not None or self.num_computed == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def append(self, new_ids: list[int], logprobs: list[dict[int, float]] | None = None) -> list[int]:
        """Append emitted tokens, stopping at max_tokens / EOS / a stop token. Returns what was kept.
        ``logprobs``: one dict per token of ``new_ids``, given exactly when the request asked for logprobs;
        those of the kept tokens are kept."""
        if (logprobs is None) != (self.logprobs is None) or (
                logprobs is not None and len(logprobs) != len(new_ids)):
            raise ValueError(f"request {self.request_id!r}: {len(new_ids)} tokens came with"
                             f" {None if logprobs is None else len(logprobs)} logprobs (it asked for"
                             f" logprobs={self.params.logprobs})")
        kept = []
        sp = self.params
        for t in new_ids:
            if len(self.output_ids) >= sp.max_tokens:
                break
            self.output_ids.append(t)
            kept.append(t)
            if t in sp.stop_token_ids or (not sp.ignore_eos and t == self.eos_token_id):
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and len(self.output_ids) >= sp.max_tokens:
            self.finish_reason = "length"
        if self.logprobs is not None:
            self.logprobs.extend(logprobs[:len(kept)])
        if kept and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        return kept

    def reset_for_recompute(self):
        """Preemption by recompute: forget the cache rows; the tokens so far become the new prompt's work."""
        self.num_computed = 0
        self.drafts = []
        self.status = Status.WAITING
        self.num_preemptions += 1
