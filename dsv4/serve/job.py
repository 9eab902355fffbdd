"""One HTTP request in the engine: its choices (prompts x n), each an engine request, and what their tokens
become (text with stop strings; for chat, reasoning / content / tool calls).

``Job.events()`` yields each choice's events until every choice has ended; ``Job.close()`` aborts whatever has
not (the client went away, a stop string matched, an error) so its cache is freed at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..engine.sampling_params import SamplingParams
from .detokenizer import OutputText
from .client import EngineClient, Event, Sink
from .messages import Update
from .parsers import ParsedToolCall, ReasoningParser, ToolCallParser
from .protocol import ApiError


@dataclass
class Delta:
    """What one event added to a choice."""

    text: str = ""  # the raw text (completions) / the content (chat)
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # set once, on the choice's last delta
    # (token id, its logprobs dict) per completion token this event consumed, when the request asked
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.tool_calls or self.finish_reason or self.logprobs)


class Choice:
    """One choice's output as it grows."""

    def __init__(self, index: int, out: OutputText, reasoning: ReasoningParser | None = None,
                 tools: ToolCallParser | None = None):
        self.index = index
        self.out = out
        self.reasoning_parser = reasoning
        self.tool_parser = tools
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ParsedToolCall] = []
        self.logprobs: list[tuple[int, dict[int, float]]] = []  # per completion token, when asked
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return self.out.num_tokens

    def consume(self, ev: Update) -> Delta:
        if self.done:
            return Delta()
        if ev.token_ids and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        before = self.out.num_tokens
        raw = self.out.add(ev.token_ids, ev.finish_reason)
        final = self.out.done
        d = Delta()
        if ev.logprobs is not None:  # the tokens counted as completion tokens (not those after a stop string)
            used = self.out.num_tokens - before
            d.logprobs = list(zip(ev.token_ids[:used], ev.logprobs[:used]))
            self.logprobs += d.logprobs
        text = raw
        if self.reasoning_parser is not None:
            d.reasoning, text = self.reasoning_parser.feed(text, final)
        if self.tool_parser is not None:
            text, d.tool_calls = self.tool_parser.feed(text, final)
        d.text = text
        self.content += d.text
        self.reasoning += d.reasoning
        self.tool_calls += d.tool_calls
        if final:
            reason = self.out.finish_reason
            if reason == "stop" and self.tool_calls:
                reason = "tool_calls"
            self.finish_reason = d.finish_reason = reason
            self.finish_time = time.perf_counter()
        return d


class Job:
    def __init__(self, engine: EngineClient, request_id: str, prompts: list[list[int]],
                 choices: list[tuple[int, SamplingParams, Choice]]):
        """``choices``: (prompt index, sampling params, output state) per choice, in choice-index order."""
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.params = [sp for _, sp, _ in choices]
        self.prompt_of = [p for p, _, _ in choices]
        self.choices = [c for _, _, c in choices]
        self.arrival = time.perf_counter()
        self._queue: asyncio.Queue | None = None
        self._open: set[int] = set()

    def rid(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def start(self) -> None:
        """Submit the choices (a 503 ``ApiError`` if the engine is not running)."""
        self.engine.check_alive()
        self._queue = asyncio.Queue()
        for i, (p, sp) in enumerate(zip(self.prompt_of, self.params)):
            self._open.add(i)
            self.engine.submit(self.rid(i), self.prompts[p], sp, Sink(self._queue, i, arrival=self.arrival))

    async def events(self):
        """(choice, delta) until every choice has ended. A failed choice raises ``ApiError`` (its status: 400 for
        a request the engine refused, 500 for an engine failure)."""
        while self._open:
            for index, u in self._merged(await self._queue.get()):
                if index not in self._open:
                    continue  # a choice that a stop string ended: its last tokens were on the way
                if u.error is not None:
                    raise ApiError(u.error, status=u.status,
                                   type="invalid_request_error" if u.status == 400 else "server_error")
                c = self.choices[index]
                d = c.consume(u)
                if c.done:
                    self._open.discard(index)
                    if u.finish_reason is None:  # ended here (a stop string): the engine need not go on
                        self.engine.abort(self.rid(index))
                if not d.empty:
                    yield c, d

    def _merged(self, first: Event) -> list[Event]:
        """``first`` and whatever else has arrived, one event per choice (tokens joined in order, up to and
        including a choice's last event: nothing follows it): a reader slower than the engine gets fewer, larger
        chunks instead of falling behind."""
        q = self._queue
        if q.empty():
            return [first]
        by_index: dict[int, list[Update]] = {first.index: [first.update]}
        while not q.empty():
            ev = q.get_nowait()
            by_index.setdefault(ev.index, []).append(ev.update)
        out = []
        for index, ups in by_index.items():
            end = next((k for k, u in enumerate(ups) if u.error is not None or u.finish_reason is not None),
                       len(ups) - 1)
            if end == 0:
                out.append(Event(index, ups[0]))
                continue
            ups = ups[:end + 1]
            tokens = [t for u in ups for t in u.token_ids]
            logprobs = None if all(u.logprobs is None for u in ups) else \
                [lp for u in ups for lp in (u.logprobs or ())]  # (an error event carries none)
            out.append(Event(index, ups[-1]._replace(token_ids=tokens, logprobs=logprobs)))
        return out

    def close(self) -> None:
        """Abort the choices that have not ended (their cache is freed); safe to call more than once."""
        for i in sorted(self._open):
            self.engine.abort(self.rid(i))
        self._open.clear()

    async def run(self) -> None:
        """Run to the end (the non-streamed answer)."""
        async for _ in self.events():
            pass

    def observe(self, metrics) -> None:
        if metrics is None:
            return
        for p, c in zip(self.prompt_of, self.choices):
            if c.finish_reason is None:
                reason = "abort"
            else:
                reason = c.finish_reason
            end = c.finish_time or time.perf_counter()
            ttft = c.first_token_time - self.arrival if c.first_token_time is not None else None
            metrics.observe_request(reason, len(self.prompts[p]), c.num_tokens, ttft, end - self.arrival)
