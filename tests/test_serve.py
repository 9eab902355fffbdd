"""``dsv4 serve`` against a real server process (uvicorn on a free port, model ``mini`` on the CPU, MTP on with
two drafts), driven by the ``openai`` client, sync and async. Every answer is compared with ``LLM.generate``'s
greedy output for the same token ids in this process (fp32 on the CPU: MTP on gives the tokens of MTP off), so
the tests fail when the server changes a token, a character or a count."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts

from .serve_server import (EOS, engine_pids, gone_within, greedy, launch, needs_proc, parent, running, stop,
                           text_of, wait_healthy)

KEY = "sk-test-dsv4"
MAX_SEQ_LEN = 512
SETTINGS = dict(max_batch_size=32, max_num_tokens=512, max_seq_len=MAX_SEQ_LEN,
                speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log_path: str):
        self.url, self.proc, self.log_path = url, proc, log_path
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def http(self, method: str, path: str, key: str | None = KEY, **kw) -> httpx.Response:
        headers = kw.pop("headers", {})
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        kw.setdefault("timeout", 60)
        return httpx.request(method, self.url + path, headers=headers, **kw)

    def metrics(self) -> dict[str, float]:
        text = self.http("GET", "/metrics", key=None).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name if s.name.endswith(("_count", "_sum", "_total")) or s.name == fam.name
                    else s.name] = out.get(s.name, 0.0) + s.value
                if "finished_reason" in s.labels:
                    k = f"{s.name}[{s.labels['finished_reason']}]"
                    out[k] = out.get(k, 0.0) + s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """The metrics once nothing runs and the cache holds nothing (slots and blocks all free)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if (m["dsv4:num_requests_running"] == 0 and m["dsv4:num_requests_waiting"] == 0
                    and m["dsv4:kv_cache_slots_used"] == 0 and m["dsv4:kv_cache_usage_perc"] == 0):
                return m
            if time.time() > deadline:
                raise AssertionError(f"the server did not go idle: {m}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server process, and (built while it starts) the in-process reference ``LLM`` as ``server.llm``. At
    the end: SIGTERM stops it and its engine process with it, with no traceback in its log."""
    d = tmp_path_factory.mktemp("serve")
    yml = d / "mtp.yml"
    yml.write_text("speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 2\n")
    proc, url, log_path = launch(d, ["--max_batch_size", "32", "--max_num_tokens", "512", "--max_seq_len",
                                      str(MAX_SEQ_LEN), "--extra_llm_api_options", str(yml), "--api_key", KEY,
                                      "--max_request_bytes", "65536"])
    engine_pid = None
    try:
        reference = LLM("mini", **SETTINGS)
        wait_healthy(proc, url, log_path)
        engine_pid = engine_pids(url)[0]
        srv = Server(url, proc, log_path)
        srv.llm = reference
        yield srv
        # uvicorn shuts down gracefully, then re-raises the signal: killed by SIGTERM, after a clean stop
        assert stop(proc) in (0, -signal.SIGTERM), open(log_path).read()
    finally:
        if proc.poll() is None:
            proc.kill()
    log = open(log_path).read()
    assert "Traceback" not in log, log  # no handler failed, nothing crashed in the engine loop
    if engine_pid is not None and os.path.isdir("/proc"):
        assert gone_within(engine_pid, 5), f"the engine process {engine_pid} outlived the server"


@pytest.fixture(scope="module")
def llm(server):
    return server.llm


def prompts(n: int, chars: int = 60) -> list[str]:
    return [p[-chars:] for p in heldout_prompts("mini")[:n]]


def _stream_completion(server, **kw):
    chunks = list(server.client.completions.create(stream=True, **kw))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(c.choices[0].text for c in chunks if c.choices), finishes, chunks


# ---- completions ------------------------------------------------------------------------------------
def test_completions_equal_generate_streamed_and_whole(server, llm):
    for prompt in prompts(2):
        ids = llm.tokenizer.encode(prompt).ids
        ref = greedy(llm, ids, 16)
        whole = server.client.completions.create(model="mini", prompt=prompt, max_tokens=16, temperature=0)
        assert whole.choices[0].text == text_of(llm, ref.token_ids)
        assert whole.choices[0].finish_reason == ref.finish_reason
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(ref.token_ids))
        assert whole.usage.total_tokens == len(ids) + len(ref.token_ids)
        text, finishes, chunks = _stream_completion(server, model="mini", prompt=prompt, max_tokens=16,
                                                    temperature=0, stream_options={"include_usage": True})
        assert text == whole.choices[0].text
        assert finishes == [ref.finish_reason]  # exactly one finish_reason
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        assert chunks[-1].usage.prompt_tokens == len(ids)
    # token ids as the prompt, and a batch of prompts: a choice per prompt
    ids = llm.tokenizer.encode(prompts(1)[0]).ids
    out = server.client.completions.create(model="mini", prompt=[ids, ids[:-3]], max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == [text_of(llm, greedy(llm, i, 8).token_ids) for i in (ids, ids[:-3])]


def test_finish_reason_stop_token_vs_length(server, llm):
    ids = llm.tokenizer.encode(prompts(2)[1]).ids
    ref = greedy(llm, ids, 20, ignore_eos=True)
    t = ref.token_ids[6]
    k = ref.token_ids.index(t)
    out = server.client.completions.create(model="mini", prompt=ids, max_tokens=20, temperature=0,
                                           extra_body={"stop_token_ids": [t], "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == llm.tokenizer.decode(ref.token_ids[:k])  # the stop token is not text
    assert out.usage.completion_tokens == k + 1
    out = server.client.completions.create(model="mini", prompt=ids, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5


def test_stop_strings_cut_across_token_boundaries(server, llm):
    """A stop string made of the end of one token and the start of the next: the text ends right before it
    (streamed too), and the tokens after the one that completed it are not counted (MTP brings several tokens
    per step, so the cut falls inside a step)."""
    tok = llm.tokenizer
    checked = 0
    for prompt in prompts(6):
        if checked == 2:
            break
        ids = tok.encode(prompt).ids
        ref = greedy(llm, ids, 24, ignore_eos=True)
        full = tok.decode(ref.token_ids)
        pieces = [tok.decode([t]) for t in ref.token_ids]
        if "".join(pieces) != full:
            continue  # a character split over tokens: pick another prompt
        for k in range(4, 22):
            a, b = pieces[k], pieces[k + 1]
            if len(a) >= 2 and len(b) >= 2:
                stop = a[-2:] + b[:2]
                break
        else:
            continue
        cut = full.find(stop)
        used = next(m for m in range(1, len(ref.token_ids) + 1) if stop in tok.decode(ref.token_ids[:m]))
        kw = dict(model="mini", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "@@never@@"],
                  extra_body={"ignore_eos": True})
        out = server.client.completions.create(**kw)
        assert out.choices[0].text == full[:cut] and out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == used
        text, finishes, _ = _stream_completion(server, **kw)
        assert text == full[:cut] and finishes == ["stop"]
        out = server.client.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                                        "include_stop_str_in_output": True}})
        assert out.choices[0].text == full[:cut + len(stop)]
        checked += 1
    assert checked == 2


def test_sampling_seed_and_n(server, llm):
    prompt = prompts(1)[0]
    kw = dict(model="mini", prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 50})
    a = server.client.completions.create(**kw)
    b = server.client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # a seed makes sampling reproducible
    ids = llm.tokenizer.encode(prompt).ids
    ref = greedy(llm, ids, 12, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    assert a.choices[0].text == text_of(llm, ref.token_ids)
    two = server.client.completions.create(**{**kw, "n": 2})  # choice j draws with seed + j
    ref1 = greedy(llm, ids, 12, temperature=0.9, top_p=0.95, top_k=50, seed=8)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [a.choices[0].text, text_of(llm, ref1.token_ids)]
    assert two.usage.completion_tokens == len(ref.token_ids) + len(ref1.token_ids)
    g = server.client.completions.create(model="mini", prompt=prompt, max_tokens=6, temperature=0, n=3)
    assert len({c.text for c in g.choices}) == 1 and g.usage.completion_tokens == 3 * 6


# ---- logprobs -----------------------------------------------------------------------------------------
LP_TOL = 1e-4  # the server's batch and this process's are computed apart (fp32 on the CPU)


def _close(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(abs(got[k] - want[k]) < LP_TOL for k in want)


def test_completions_logprobs_equal_generate(server, llm):
    """OpenAI's legacy shape: per completion token its text, its logprob, the chosen token and the top n as
    {text: logprob}, and where its text starts; streamed chunks add up to the whole answer."""
    tok = llm.tokenizer
    ids = tok.encode(prompts(2)[1]).ids
    ref = greedy(llm, ids, 12, logprobs=3)
    text = [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    kw = dict(model="mini", prompt=ids, max_tokens=12, temperature=0, logprobs=3)
    whole = server.client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    assert lp.tokens == text and whole.usage.completion_tokens == len(text)
    assert all(abs(a - b[t]) < LP_TOL for a, b, t in zip(lp.token_logprobs, ref.logprobs, ref.token_ids))
    assert all(_close(got, {tok.decode([k], skip_special_tokens=False): v for k, v in want.items()})
               for got, want in zip(lp.top_logprobs, ref.logprobs))
    assert all(len(top) in (3, 4) for top in lp.top_logprobs)  # the top 3, and the chosen token if not among them
    assert lp.text_offset == [sum(len(x) for x in text[:i]) for i in range(len(text))]
    _, _, chunks = _stream_completion(server, **kw)
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(parts) > 1  # several chunks carried logprobs
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, field)] == getattr(lp, field), field
    plain = server.client.completions.create(model="mini", prompt=ids, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_equal_generate(server, llm):
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: the top n, best first}]}, streamed
    and whole; logprobs true alone gives each token's logprob and no top list."""
    tok = llm.tokenizer
    messages = [{"role": "user", "content": prompts(1)[0]}]
    ids = server.http("POST", "/tokenize", json={"messages": messages}).json()["tokens"]
    ref = greedy(llm, ids, 10, logprobs=2)
    kw = dict(model="mini", messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = server.client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == whole.usage.completion_tokens
    for c, t, want in zip(content, ref.token_ids, ref.logprobs):
        assert c.token == tok.decode([t], skip_special_tokens=False) and c.bytes == list(c.token.encode())
        assert abs(c.logprob - want[t]) < LP_TOL
        best = sorted(want.items(), key=lambda kv: -kv[1])[:2]
        assert [x.token for x in c.top_logprobs] == [tok.decode([k], skip_special_tokens=False) for k, _ in best]
        assert all(abs(x.logprob - v) < LP_TOL for x, (_, v) in zip(c.top_logprobs, best))
    _, _, _, _, chunks = _chat_stream(server, **kw)
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]
    bare = server.client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert [(x.token, x.top_logprobs) for x in bare.choices[0].logprobs.content] == [(x.token, []) for x in content]
    assert server.client.chat.completions.create(model="mini", messages=messages, max_tokens=2,
                                                 temperature=0).choices[0].logprobs is None


# ---- chat -------------------------------------------------------------------------------------------
def _chat_stream(server, **kw):
    chunks = list(server.client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    alias = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert deltas[0].role == "assistant"
    return content, reasoning, alias, finishes, chunks


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_equals_generate_streamed_and_whole(server, llm, thinking):
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": prompts(1)[0]}]
    kwargs = {"chat_template_kwargs": {"thinking": thinking}}
    ids = server.http("POST", "/tokenize", json={"messages": messages, **kwargs}).json()["tokens"]
    assert ids[0] == tok.token_to_id("<｜begin▁of▁sentence｜>")
    assert ids[-2:] == [tok.token_to_id("<｜Assistant｜>"), tok.token_to_id("<think>" if thinking else "</think>")]
    ref = greedy(llm, ids, 20)
    raw = tok.decode(ref.token_ids[:-1] if ref.token_ids[-1] == EOS else ref.token_ids, skip_special_tokens=False)
    want_reasoning, sep, want_content = raw.partition("</think>") if thinking else ("", "", raw)
    if thinking and not sep:
        want_reasoning, want_content = raw, ""
    whole = server.client.chat.completions.create(model="mini", messages=messages, max_tokens=20, temperature=0,
                                                  extra_body=kwargs)
    msg = whole.choices[0].message
    assert msg.content == want_content
    assert ((msg.model_extra or {}).get("reasoning_content") or "") == want_reasoning
    assert ((msg.model_extra or {}).get("reasoning") or "") == want_reasoning
    assert whole.choices[0].finish_reason == ref.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    content, reasoning, alias, finishes, chunks = _chat_stream(
        server, model="mini", messages=messages, max_completion_tokens=20, temperature=0, extra_body=kwargs,
        stream_options={"include_usage": True})
    assert (content, reasoning, alias) == (want_content, want_reasoning, want_reasoning)
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ids) + len(ref.token_ids)


def test_chat_with_tools(server, llm):
    """Tools reach the prompt (DeepSeek-V4's tools section); mini writes no DSML, so the answer is content
    equal to the greedy output of that prompt, streamed and whole (the parsing itself: test_serve_text.py)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "def weather(city):"}]
    ids = server.http("POST", "/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]
    prompt = llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert "## Tools" in prompt and '"name": "get_weather"' in prompt
    ref = greedy(llm, ids, 12)
    raw = llm.tokenizer.decode(ref.token_ids[:-1] if ref.token_ids[-1] == EOS else ref.token_ids,
                               skip_special_tokens=False)
    whole = server.client.chat.completions.create(model="mini", messages=messages, tools=tools, max_tokens=12,
                                                  temperature=0)
    assert whole.choices[0].message.content == raw and not whole.choices[0].message.tool_calls
    content, _, _, finishes, _ = _chat_stream(server, model="mini", messages=messages, tools=tools, max_tokens=12,
                                              temperature=0)
    assert content == raw and finishes == [ref.finish_reason]


# ---- concurrency, disconnects, metrics -------------------------------------------------------------------
def test_32_concurrent_streams_each_equal_their_solo_output(server, llm):
    """32 streams at once (one continuous batch on the server) each give the greedy output of their prompt:
    compared with one batched ``LLM.generate`` of the same prompts, and four of them with a generate of their
    prompt alone (the engine's own tests hold batched == alone for every request; alone costs ~0.4 s each)."""
    texts = prompts(32, chars=48)
    outs = llm.generate(texts, SamplingParams(max_tokens=16))
    solo = [text_of(llm, o.outputs[0].token_ids) for o in outs]
    for i in (0, 9, 20, 31):
        assert solo[i] == text_of(llm, greedy(llm, llm.tokenizer.encode(texts[i]).ids, 16).token_ids)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(p):
        stream = await client.completions.create(model="mini", prompt=p, max_tokens=16, temperature=0, stream=True)
        parts, finishes = [], []
        async for c in stream:
            parts.append(c.choices[0].text)
            if c.choices[0].finish_reason:
                finishes.append(c.choices[0].finish_reason)
        return "".join(parts), finishes

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in texts))
        finally:
            await client.close()

    before = server.metrics()
    results = asyncio.run(main())
    assert [r[0] for r in results] == solo
    assert all(len(r[1]) == 1 for r in results)
    after = server.wait_idle()
    assert after["dsv4:request_success_total"] - before["dsv4:request_success_total"] == 32


def test_disconnect_aborts_and_frees_the_cache(server, llm):
    before = server.wait_idle()
    body = {"model": "mini", "prompt": prompts(1)[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(g.startswith("data: ") for g in got)
        # leaving the block closes the connection mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a whole answer whose client gives up
        server.http("POST", "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    after = server.wait_idle()
    assert after["dsv4:request_success_total[abort]"] - before.get("dsv4:request_success_total[abort]", 0) == 2
    # neither ran to its 400 tokens, and the server still answers right
    assert after["dsv4:generation_tokens_total"] - before.get("dsv4:generation_tokens_total", 0) < 2 * 400
    ids = llm.tokenizer.encode(prompts(2)[1]).ids
    out = server.client.completions.create(model="mini", prompt=ids, max_tokens=10, temperature=0)
    assert out.choices[0].text == text_of(llm, greedy(llm, ids, 10).token_ids)
    server.wait_idle()


def test_metrics_parse_and_count(server):
    server.client.completions.create(model="mini", prompt="def f(x):", max_tokens=4, temperature=0)
    text = server.http("GET", "/metrics", key=None).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("dsv4:request_success", "dsv4:time_to_first_token_seconds", "dsv4:e2e_request_latency_seconds",
                 "dsv4:time_per_output_token_seconds", "dsv4:request_queue_time_seconds", "dsv4:prompt_tokens",
                 "dsv4:generation_tokens", "dsv4:kv_cache_usage_perc", "dsv4:num_requests_running",
                 "dsv4:spec_decode_acceptance_rate", "dsv4:spec_decode_num_draft_tokens", "dsv4:engine_step_seconds",
                 "dsv4:spec_decode_drafting_paused"):
        assert name in fams, (name, sorted(fams))
    m = server.metrics()
    assert m["dsv4:time_to_first_token_seconds_count"] >= 1 and m["dsv4:request_queue_time_seconds_count"] >= 1
    assert m["dsv4:generation_tokens_total"] >= 4 and m["dsv4:kv_cache_slots"] == 32
    assert 0 < m["dsv4:spec_decode_acceptance_rate"] <= 1  # MTP is on and mini's drafts are often right
    # the pause is on by default; whether it is paused now depends on this module's traffic (its acceptance is
    # about 0.5 over all its requests, and how far its aborted streams got varies) and on when it last probed:
    # test_serve_wire.py checks that the gauge follows the engine's state
    assert m["dsv4:spec_decode_drafting_paused"] in (0, 1)
    kinds = {s.labels["kind"] for s in fams["dsv4:engine_step_seconds"].samples}
    assert {"prefill", "eager"} <= kinds <= {"prefill", "eager", "graph", "readback"}, kinds  # (no graphs on the CPU)


# ---- the other endpoints, and what a client gets wrong ---------------------------------------------------
def test_models_health_version_tokenize(server, llm):
    assert [m.id for m in server.client.models.list().data] == ["mini"]
    assert server.http("GET", "/health", key=None).status_code == 200
    assert server.http("GET", "/version", key=None).json()["version"]
    ids = llm.tokenizer.encode("def f(x):\n    return 'é'").ids
    r = server.http("POST", "/tokenize", json={"prompt": "def f(x):\n    return 'é'"}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == MAX_SEQ_LEN
    back = server.http("POST", "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back == llm.tokenizer.decode(ids, skip_special_tokens=False)


LONG = list(range(10, 10 + MAX_SEQ_LEN))
BAD = [  # (what, path, json body or raw bytes, status, param)
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 400, "model"),
    ("max_tokens 0", "/v1/completions", {"model": "mini", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens < 0", "/v1/chat/completions",
     {"model": "mini", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, 400, "max_tokens"),
    ("prompt longer than max_seq_len", "/v1/completions", {"model": "mini", "prompt": LONG}, 400, "prompt"),
    ("prompt + max_tokens over max_seq_len", "/v1/completions",
     {"model": "mini", "prompt": LONG[:500], "max_tokens": 100}, 400, "max_tokens"),
    ("malformed JSON", "/v1/completions", b'{"model": "mini", "prompt": ', 400, None),
    ("a JSON list", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("wrong type", "/v1/completions", {"model": "mini", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("string for an int", "/v1/completions", {"model": "mini", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("missing prompt", "/v1/completions", {"model": "mini"}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"model": "mini", "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": "mini", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("token outside the vocabulary", "/v1/completions", {"model": "mini", "prompt": [1, 99999]}, 400, "prompt"),
    ("negative temperature", "/v1/completions", {"model": "mini", "prompt": "x", "temperature": -1}, 400,
     "temperature"),
    ("top_p 0", "/v1/completions", {"model": "mini", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n 0", "/v1/completions", {"model": "mini", "prompt": "x", "n": 0}, 400, "n"),
    ("n too large", "/v1/completions", {"model": "mini", "prompt": "x", "n": 1000}, 400, "n"),
    ("logprobs over 20", "/v1/completions", {"model": "mini", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("negative logprobs", "/v1/completions", {"model": "mini", "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": "mini", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs over 20", "/v1/chat/completions", {"model": "mini", "messages": [
        {"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("stream_options without stream", "/v1/completions",
     {"model": "mini", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("empty stop string", "/v1/completions", {"model": "mini", "prompt": "x", "stop": [""]}, 400, "stop"),
    ("image content", "/v1/chat/completions", {"model": "mini", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("bad reasoning_effort", "/v1/chat/completions", {"model": "mini", "messages": [
        {"role": "user", "content": "x"}], "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [5, -1]}, 400, "tokens"),
    ("too large a body", "/v1/completions", {"model": "mini", "prompt": "x" * 70000}, 413, None),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_get_openai_errors(server, what, path, body, status, param):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = server.http("POST", path, **kw)
    assert r.status_code == status, (what, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err


def test_api_key_and_client_errors(server):
    for key in (None, "sk-wrong"):
        r = server.http("POST", "/v1/completions", key=key, json={"model": "mini", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="mini", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=MAX_SEQ_LEN)
    assert "maximum context length" in str(e.value)
    assert server.http("GET", "/nowhere").status_code == 404
    server.wait_idle()  # nothing refused was left in the engine


# ---- the engine's own process ----------------------------------------------------------------------------
@needs_proc
def test_the_engine_runs_in_a_child_process(server):
    engine, http = engine_pids(server.url)
    assert http == server.proc.pid and engine != http
    assert parent(engine) == server.proc.pid and running(engine)
