"""The serving path's pieces, without a model: the engine loop and the HTTP side's client of it over a real pipe
(updates as plain tuples on the wire; messages written directly or through the sender thread, in order), the
step kinds and the slow-step log, the stream chunks' JSON, and how ``Job`` coalesces queued events."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from types import SimpleNamespace

import pytest

from dsv4.engine.outputs import CompletionOutput, RequestOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.serve import loop as loop_module
from dsv4.serve.client import EngineClient, Event, Sink
from dsv4.serve.host import EngineThread
from dsv4.serve.job import Job
from dsv4.serve.messages import Update
from dsv4.serve.metrics import ServerMetrics
from dsv4.serve.protocol import StreamChunks, response_body, usage


class FakeEngine:
    """What the engine loop reads of an LLMEngine: every step gives each request its next token (100 + its
    position), a new request's first step counting its prompt as a prefill chunk; ``log`` records adds and aborts
    in the order the engine saw them."""

    max_seq_len = 4096

    def __init__(self):
        self.requests: dict[str, SimpleNamespace] = {}
        self.log: list[tuple[str, str]] = []
        self.num_steps = 0
        self.last_step: dict = {}
        self.cache = SimpleNamespace(check_integrity=lambda: None)

    def add_request(self, prompt_ids, params, request_id=None):
        self.log.append(("add", request_id))
        self.requests[request_id] = SimpleNamespace(prompt=list(prompt_ids), max_tokens=params.max_tokens, out=[],
                                                    first_scheduled_time=None)
        return request_id

    def abort_request(self, request_id):
        self.log.append(("abort", request_id))
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        now, outs, tokens = time.perf_counter(), [], 0
        for rid, r in list(self.requests.items()):
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
                tokens += len(r.prompt)
            else:
                tokens += 1
            r.out.append(100 + len(r.out))
            done = len(r.out) >= r.max_tokens
            outs.append(RequestOutput(rid, r.prompt, [CompletionOutput(0, list(r.out), None,
                                                                       "length" if done else None)], done))
            if done:
                del self.requests[rid]
        self.num_steps += 1
        self.last_step = {"step": self.num_steps, "num_seqs": len(outs), "num_tokens": tokens}
        time.sleep(0.001)
        return outs

    def get_stats(self) -> dict:
        n = len(self.requests)
        return {"num_running": n, "num_waiting": 0, "speculative": None,
                "kv_cache_usage": {"num_blocks": 8, "used_blocks": 0, "num_slots": 64, "used_slots": n}}


def _fake_llm(engine: FakeEngine):
    return SimpleNamespace(engine=engine, tokenizer=None,
                           model_config=SimpleNamespace(vocab_size=1000, eos_token_id=1))


def test_updates_reach_their_sinks_in_order_through_both_send_paths():
    """40 requests, the connection said to have room for every other message (the others go through the sender
    thread, and so does whatever follows them until it has written them), every fifth request aborted right after
    its add: each request that was not aborted gets its tokens in order and one finish, the aborted ones nothing,
    and the engine sees each request's add before its abort."""
    engine = FakeEngine()
    host = EngineThread(_fake_llm(engine))
    client = EngineClient(host)
    room = itertools.cycle([False, True])
    client._has_room = lambda: next(room)
    lengths = {f"r{i}": 3 + i % 7 for i in range(40)}
    aborted = {f"r{i}" for i in range(40) if i % 5 == 4}

    async def main():
        client.start()
        queues = {}
        for rid, n in lengths.items():
            queues[rid] = asyncio.Queue()
            client.submit(rid, [5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True), Sink(queues[rid], 0))
            if rid in aborted:
                client.abort(rid)
            await asyncio.sleep(0.0005 * (len(queues) % 3))

        async def drain(rid):
            tokens, finishes = [], []
            while not finishes:
                ev = await asyncio.wait_for(queues[rid].get(), 30)
                assert isinstance(ev, Event) and isinstance(ev.update, Update) and ev.update.rid == rid
                tokens += ev.update.token_ids
                if ev.update.finish_reason is not None:
                    finishes.append(ev.update.finish_reason)
            return tokens, finishes

        got = await asyncio.gather(*(drain(rid) for rid in lengths if rid not in aborted))
        await asyncio.sleep(0.05)
        left = {rid: queues[rid].qsize() for rid in aborted}
        client.stop()
        return got, left

    got, left = asyncio.run(main())
    live = [rid for rid in lengths if rid not in aborted]
    assert got == [([100 + k for k in range(lengths[rid])], ["length"]) for rid in live]
    assert left == {rid: 0 for rid in aborted}
    first = {}
    for what, rid in engine.log:
        first.setdefault(rid, what)
    assert all(what == "add" for what in first.values()), engine.log
    assert {rid for what, rid in engine.log if what == "add"} == set(lengths)


def test_step_kinds_and_slow_steps_reach_the_metrics_and_the_log(monkeypatch, caplog):
    """A request's first step (its prompt) is a prefill step, the others eager decode steps (no CUDA graphs
    here); each is observed in dsv4:engine_step_seconds by kind, and a step slower than SLOW_STEP_S is logged."""
    monkeypatch.setattr(loop_module, "SLOW_STEP_S", 0.0)
    engine = FakeEngine()
    metrics = ServerMetrics("fake")
    client = EngineClient(EngineThread(_fake_llm(engine)), metrics)

    async def main():
        client.start()
        q = asyncio.Queue()
        client.submit("a", [1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True), Sink(q, 0))
        while (await asyncio.wait_for(q.get(), 30)).update.finish_reason is None:
            pass
        client.stop()

    with caplog.at_level("WARNING", logger="dsv4.serve"):
        asyncio.run(main())
    counts = {s.labels["kind"]: s.value for fam in metrics.registry.collect() for s in fam.samples
              if s.name == "dsv4:engine_step_seconds_count"}
    assert counts == {"prefill": 1, "eager": 3}, counts
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(slow) == 4 and "(prefill: 1 requests, 4 new tokens)" in slow[0], slow


class PausingEngine(FakeEngine):
    """A FakeEngine with MTP stats: 2 drafts a step, 1 accepted, and drafting paused from step ``paused_from``
    (None: never)."""

    def __init__(self, paused_from: int | None):
        super().__init__()
        self.paused_from = paused_from

    def get_stats(self) -> dict:
        paused = self.paused_from is not None and self.num_steps >= self.paused_from
        return {**super().get_stats(), "speculative": {"num_draft_tokens": 2 * self.num_steps,
                                                      "num_accepted_tokens": self.num_steps,
                                                      "pause": {"paused": paused}}}


@pytest.mark.parametrize("paused_from, gauge", [(2, 1), (None, 0)])
def test_the_drafting_paused_gauge_follows_the_engine(paused_from, gauge):
    """dsv4:spec_decode_drafting_paused is the engine's pause state after its last step (1 paused, 0 drafting),
    beside the draft counters taken from the same stats."""
    metrics = ServerMetrics("fake")
    client = EngineClient(EngineThread(_fake_llm(PausingEngine(paused_from))), metrics)

    async def main():
        client.start()
        q = asyncio.Queue()
        client.submit("a", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True), Sink(q, 0))
        while (await asyncio.wait_for(q.get(), 30)).update.finish_reason is None:
            pass
        client.stop()

    asyncio.run(main())
    got = {s.name: s.value for fam in metrics.registry.collect() for s in fam.samples}
    assert got["dsv4:spec_decode_drafting_paused"] == gauge
    assert got["dsv4:spec_decode_num_draft_tokens_total"] == 2 * got["dsv4:spec_decode_num_accepted_tokens_total"] > 0


@pytest.mark.parametrize("kind", ["text_completion", "chat.completion.chunk"])
@pytest.mark.parametrize("with_usage", [False, True])
@pytest.mark.parametrize("model", ["mini", 'odd "choices": [] ☃ name'])
def test_stream_chunks_are_json_dumps_of_the_response_body(kind, with_usage, model):
    chunks = StreamChunks(kind, "cmpl-abc", 1700000000, model, with_usage)

    def want(choices, usage_=None):
        body = response_body(kind, "cmpl-abc", 1700000000, model, choices, usage_, with_usage)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    one = [{"index": 0, "text": 'é "quoted"\n\\ \u2028 ☃', "logprobs": None, "finish_reason": None}]
    two = [{"index": 1, "delta": {"content": "x"}, "logprobs": {"content": [{"token": "x", "logprob": -0.5,
                                                                           "bytes": [120]}]},
            "finish_reason": "stop"}, one[0]]
    for choices in ([], one, two):
        assert chunks(choices) == want(choices)
    assert chunks.usage(usage(3, 4)) == want([], usage(3, 4))


def _merged_reference(first: Event, rest: list[Event]) -> list[Event]:
    """Job._merged as it was first written (one event folded in at a time): the oracle."""
    if not rest:
        return [first]
    by_index = {first.index: first}
    for ev in rest:
        prev = by_index.get(ev.index)
        if prev is None or prev.update.error is not None or prev.update.finish_reason is not None:
            by_index.setdefault(ev.index, ev)
            continue
        p, u = prev.update, ev.update
        logprobs = None if p.logprobs is None and u.logprobs is None else (p.logprobs or []) + (u.logprobs or [])
        by_index[ev.index] = Event(ev.index, u._replace(token_ids=p.token_ids + u.token_ids, logprobs=logprobs))
    return list(by_index.values())


def test_job_coalesces_queued_events_as_before():
    """Random runs of queued events (3 choices; tokens with and without logprobs; finishes, errors, events after
    a choice's last one): what Job._merged makes of them is the reference fold's, event for event."""
    rng = random.Random(0)
    for _ in range(500):
        events = []
        for _ in range(rng.randint(1, 12)):
            i = rng.randrange(3)
            toks = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
            lps = [{t: -1.0} for t in toks] if rng.random() < 0.5 else None
            end = rng.random()
            if end < 0.1:
                u = Update(f"r-{i}", [], "error", "boom", 500)
            else:
                u = Update(f"r-{i}", toks, "stop" if end < 0.3 else None, None, 500, lps)
            events.append(Event(i, u))
        job = Job(SimpleNamespace(), "r", [[1]], [])
        job._queue = asyncio.Queue()
        for ev in events[1:]:
            job._queue.put_nowait(ev)
        assert job._merged(events[0]) == _merged_reference(events[0], events[1:])
        assert job._queue.empty()


def test_serve_pads_decode_batches_on_cuda_unless_the_yaml_says_otherwise():
    """dsv4 serve's own default (launch.serve_defaults): cuda_graph_config.enable_padding on CUDA, merged under
    the YAML key by key; nothing on the CPU."""
    from dsv4.bench.options import resolve
    from dsv4.serve.launch import serve_defaults

    def graphs(device, yaml):
        return resolve({"max_batch_size": 8, "device": "cpu"}, yaml, "x.yml", derived=serve_defaults(device)) \
            .config.cuda_graph_config

    assert graphs("cuda", {}).enable_padding is True
    assert graphs("cuda:1", {"cuda_graph_config": {"batch_sizes": [1, 8]}}).batch_sizes == [1, 8]
    assert graphs("cuda", {"cuda_graph_config": {"batch_sizes": [1, 8]}}).enable_padding is True
    assert graphs("cuda", {"cuda_graph_config": {"enable_padding": False}}).enable_padding is False
    assert graphs("cpu", {}) is None


def test_batch_wait_holds_new_requests_until_they_fill_the_batch_or_wait_long_enough():
    """EngineLoop(batch_wait_steps=40) while one long request runs: two requests that come a step apart reach the
    engine together, 40 steps after the first came; with room for only two more, the second fills the batch and
    both go at once; an aborted held request never reaches the engine; an idle engine takes a request at once.
    Their tokens are what they are without holding."""
    engine = FakeEngine()
    engine.cfg = SimpleNamespace(max_batch_size=8)
    client = EngineClient(EngineThread(_fake_llm(engine), batch_wait_steps=40))
    added_at: dict[str, int] = {}
    add = engine.add_request

    def recording_add(prompt_ids, params, request_id=None):
        added_at[request_id] = engine.num_steps
        return add(prompt_ids, params, request_id)

    engine.add_request = recording_add
    came: dict[str, int] = {}

    async def main():
        client.start()
        queues = {}

        def submit(rid, n):
            queues[rid] = asyncio.Queue()
            came[rid] = engine.num_steps
            client.submit(rid, [5, 6], SamplingParams(max_tokens=n, ignore_eos=True), Sink(queues[rid], 0))

        async def next_step():
            n = engine.num_steps
            while engine.num_steps == n:
                await asyncio.sleep(0.0005)

        async def until_done(rid):
            tokens = []
            while True:
                u = (await asyncio.wait_for(queues[rid].get(), 30)).update
                tokens += u.token_ids
                if u.finish_reason is not None:
                    return tokens

        submit("first", 1000)  # the engine is idle: taken at once
        await next_step()
        submit("b", 4)
        await next_step()
        await next_step()
        submit("c", 4)
        submit("gone", 4)
        client.abort("gone")
        got_b, got_c = await until_done("b"), await until_done("c")
        engine.cfg.max_batch_size = len(engine.requests) + 2  # room for two more
        submit("d", 3)
        await next_step()
        submit("e", 3)
        got_d, got_e = await until_done("d"), await until_done("e")
        client.abort("first")
        await asyncio.sleep(0.05)
        client.stop()
        return [got_b, got_c, got_d, got_e]

    tokens = asyncio.run(main())
    assert added_at["first"] == 0
    assert added_at["c"] > came["c"] and added_at["b"] == added_at["c"], (added_at, came)
    assert came["b"] + 40 <= added_at["b"] <= came["b"] + 45, (added_at, came)
    assert "gone" not in added_at
    assert added_at["d"] == added_at["e"] < came["d"] + 40, (added_at, came)
    assert tokens == [[100, 101, 102, 103]] * 2 + [[100, 101, 102]] * 2
