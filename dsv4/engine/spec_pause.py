"""When drafting stops paying: the engine's MTP drafting paused while too few drafts are accepted.

A verify step costs more than a decode step (its draft rows, the MTP layer's passes, the head read again per
draft), so speculation is slower than none when the drafts are mostly rejected (a model whose MTP layer was not
trained with it, text the MTP layer predicts badly). ``DraftPause`` watches the acceptance the engine reads back
and, once the last ``window`` verified drafts were accepted less often than ``below``, pauses drafting: the
engine's steps then propose nothing (one row per request, as with MTP off) and only keep the MTP layer's cache
current (``DeepseekV4.mtp_keep_up``: the window rows its attention stores for the step's rows, the same bits as
its whole pass, without the attention output, the MoE or the head), so that drafting can start again at any
step. Every ``probe_every`` paused steps one step drafts again (a probe); the acceptance read back from probes
resumes drafting when it reaches ``below``. Each probe that does not resume doubles the paused steps before the
next, up to ``max_probe_every`` (a probe costs a drafting step and a verify step: at zero acceptance it is all of
what paused MTP costs beyond its keep-up passes); a resume starts again from ``probe_every``. A paused step
more than ``margin`` steps before the next probe need not keep the MTP layer's ring current at all
(``keep_rows`` 0): with ``margin`` the ring's span, the rows it would write have left the window by the time a
probe reads it (the engine checks that each request's ring is current before it drafts, ``mtp_current``). For
the same reason one within ``margin`` steps of the probe writes only each request's last rows that will still
be in the span then (``keep_rows``): a prompt chunk's few last, not its last ``margin``.

The outputs do not depend on it (drafts change only how many tokens a step emits); it is plain host
bookkeeping, one decision per step (``drafts_now``), fed by the engine's reads of each verdict (``record``).
"""

from __future__ import annotations

from collections import deque


class DraftPause:
    def __init__(self, below: float, window: int = 32, probe_every: int = 32, max_probe_every: int | None = None):
        if not 0 <= below <= 1:
            raise ValueError(f"pause threshold {below}: an acceptance rate in [0, 1]")
        if window < 1 or probe_every < 1:
            raise ValueError(f"window {window} and probe_every {probe_every} must be >= 1")
        max_probe_every = probe_every if max_probe_every is None else max_probe_every
        if max_probe_every < probe_every:
            raise ValueError(f"max_probe_every {max_probe_every} must be >= probe_every {probe_every}")
        self.below, self.window, self.probe_every, self.max_probe_every = below, window, probe_every, max_probe_every
        self.reset()

    def reset(self) -> None:
        self.paused = False
        self._recent: deque[tuple[int, int]] = deque()  # (drafts, accepted) per verified seq, newest last
        self._drafts = self._accepted = 0  # their sums
        self._since_probe = 0
        self.probe_interval = self.probe_every  # paused steps before the next probe (doubled by each failed one)
        self.num_pauses = self.num_resumes = self.num_paused_steps = 0

    def pause_now(self, since_probe: int = 0) -> None:
        """Paused from this step on, ``since_probe`` paused steps past the last probe (warmup's paths: a pause
        that starts far from a probe)."""
        if not 0 <= since_probe < self.probe_interval:
            raise ValueError(f"since_probe {since_probe}: in [0, probe_interval={self.probe_interval})")
        self.paused, self._since_probe = True, since_probe
        self._clear()

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify read back: ``num_accepted`` of its ``num_drafts`` drafts accepted."""
        if num_drafts <= 0:
            return
        self._recent.append((num_drafts, num_accepted))
        self._drafts += num_drafts
        self._accepted += num_accepted
        if self.paused:
            return  # (probes: judged once a step, in drafts_now)
        while self._drafts - self._recent[0][0] >= self.window:
            d, a = self._recent.popleft()
            self._drafts -= d
            self._accepted -= a

    @property
    def rate(self) -> float | None:
        """The acceptance of the drafts held (None: none held)."""
        return self._accepted / self._drafts if self._drafts else None

    def _clear(self) -> None:
        self._recent.clear()
        self._drafts = self._accepted = 0

    def drafts_now(self) -> bool:
        """Whether this step's requests draft for the next step (called once per step that proposes)."""
        if not self.paused:
            if self._drafts >= self.window and self.rate < self.below:
                self.paused, self._since_probe, self.probe_interval = True, 0, self.probe_every
                self.num_pauses += 1
                self._clear()
            else:
                return True
        elif self._drafts:  # probes read back since the last decision
            if self.rate >= self.below:
                self.paused = False
                self.num_resumes += 1
                return True
            self._clear()
            self.probe_interval = min(2 * self.probe_interval, self.max_probe_every)
        self._since_probe += 1
        if self._since_probe >= self.probe_interval:
            self._since_probe = 0
            return True  # a probe
        self.num_paused_steps += 1
        return False

    def keep_rows(self, margin: int) -> int:
        """How many of each request's newest rows this step (after its ``drafts_now``) writes to the MTP layer's
        ring, ``margin`` being the ring's span: all (``margin``) while not paused and in the two steps after a
        probe (the one that verifies its drafts and, overlapped, the one launched before they are read back: a
        resume may follow them); none more than ``margin`` steps before the next probe; in between, d steps
        before it, the last ``margin - d + 1``: a request moves on by a row at least each step, so at the probe
        its ring's span starts after the earlier ones. (A decode row, one a request, is then kept whole; a
        prompt chunk arriving about ``margin`` steps before the probe keeps a few of its rows, not its last
        ``margin``.)"""
        if not self.paused or self._since_probe <= 2:
            return margin
        return max(0, margin - (self.probe_interval - self._since_probe) + 1)

    def as_dict(self) -> dict:
        return {"paused": self.paused, "below": self.below, "num_pauses": self.num_pauses,
                "num_resumes": self.num_resumes, "num_paused_steps": self.num_paused_steps,
                "probe_interval": self.probe_interval}
