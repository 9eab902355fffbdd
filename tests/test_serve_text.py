"""The server's text layer without a server: DeepSeek-V4's chat format, reading reasoning and DSML tool calls
back (streamed in any chunking == whole), incremental detokenization and stop strings (any grouping of the
tokens, as MTP steps bring them, == one at a time == a full decode)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.builtin import builtin_path
from dsv4.checkpoint.tokenizer import load_tokenizer
from dsv4.serve.chat import ChatEncoder, chat_options, encode_dsv4, render_tool_calls
from dsv4.serve.detokenizer import IncrementalDetokenizer, OutputText
from dsv4.serve.job import Choice
from dsv4.serve.messages import Update
from dsv4.serve.parsers import ReasoningParser, ToolCallParser
from dsv4.serve.protocol import ApiError, ChatCompletionRequest

TOK = load_tokenizer(builtin_path("mini"))
D = "｜DSML｜"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


def _req(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **kw})


# ---- the chat format --------------------------------------------------------------------------------
def test_chat_and_thinking_prompts():
    r = _req([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
              {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}])
    chat = encode_dsv4(r.messages, chat_options(None, None))
    assert chat == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
                    "<｜User｜>2+2?<｜Assistant｜></think>")
    think = encode_dsv4(r.messages, chat_options({"thinking": True}, None))
    # earlier turns drop their reasoning; the new turn opens it
    assert think == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
                     "<｜User｜>2+2?<｜Assistant｜><think>")
    top = encode_dsv4(r.messages, chat_options({"thinking": True}, "max"))
    assert top.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum") and top.endswith("<think>")
    assert chat_options({"thinking": True}, "none").thinking is False
    assert chat_options({"thinking": True, "reasoning_effort": "medium"}, None).reasoning_effort == "high"
    with pytest.raises(ApiError):
        chat_options({"thinking": "yes"}, None)
    with pytest.raises(ApiError):  # nothing for the assistant to answer
        encode_dsv4(_req([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]).messages,
                    chat_options(None, None))


def test_tool_round_trip_prompt():
    """Tools go into the system turn, the assistant's calls become a DSML block, tool results one user turn of
    <tool_result> blocks in the order of the calls; with tools every turn keeps its reasoning."""
    r = _req([{"role": "user", "content": "Weather in Paris and Rome?"},
              {"role": "assistant", "content": "", "reasoning_content": "use the tool",
               "tool_calls": [{"id": "a", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                              {"id": "b", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
              {"role": "tool", "tool_call_id": "b", "content": "rain"},
              {"role": "tool", "tool_call_id": "a", "content": "sun"}], tools=[WEATHER])
    text = encode_dsv4(r.messages, chat_options({"thinking": True}, None), r.tools)
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    system, rest = text.split("<｜User｜>", 1)
    assert system.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n") and system.endswith(
        schema + "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool"
                 " calls.\n")
    assert rest == (
        "Weather in Paris and Rome?<｜Assistant｜><think>use the tool</think>\n\n"
        f"<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
        f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
        f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n</{D}invoke>\n"
        f"<{D}invoke name=\"get_weather\">\n<{D}parameter name=\"city\" string=\"true\">Rome</{D}parameter>\n"
        f"</{D}invoke>\n</{D}tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result><｜Assistant｜><think>")


def test_a_checkpoints_template_wins():
    enc = ChatEncoder("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                      "{% if add_generation_prompt %}[assistant]{% endif %}{{ extra }}")
    r = _req([{"role": "user", "content": "hi"}])
    assert enc.encode(r.messages, chat_options(None, None), template_kwargs={"extra": "!"}) == \
        "<｜begin▁of▁sentence｜>[user]hi[assistant]!"
    bad = ChatEncoder("{{ raise_exception('no system role') }}")
    with pytest.raises(ApiError, match="no system role"):
        bad.encode(r.messages, chat_options(None, None))


# ---- reading the answer back ------------------------------------------------------------------------
ANSWER = ("I will look.\n\n" + f"<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
          f"<{D}parameter name=\"city\" string=\"true\">Saint-Étienne</{D}parameter>\n"
          f"<{D}parameter name=\"days\" string=\"false\">3</{D}parameter>\n</{D}invoke>\n"
          f"<{D}invoke name=\"now\">\n</{D}invoke>\n</{D}tool_calls>")


def _chunks(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _parse(parts: list[str]):
    p = ToolCallParser()
    content, calls = "", []
    for i, part in enumerate(parts):
        c, k = p.feed(part, final=i == len(parts) - 1)
        content += c
        calls += k
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_tool_calls_parse():
    content, calls = _parse([ANSWER])
    assert content == "I will look."
    assert calls == [("get_weather", {"city": "Saint-Étienne", "days": 3}), ("now", {})]
    assert _parse(["plain text, no tools\n\n"]) == ("plain text, no tools\n\n", [])
    unfinished = f"text\n\n<{D}tool_calls>\n<{D}invoke name=\"x\">"  # cut off: given back as text
    assert _parse([unfinished]) == (f"text<{D}tool_calls>\n<{D}invoke name=\"x\">", [])
    direct = f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n{{\"a\": [1, 2]}}\n</{D}invoke>\n</{D}tool_calls>"
    assert _parse([direct]) == ("", [("f", {"a": [1, 2]})])


def test_encoded_calls_parse_back():
    r = _req([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"s": "a b", "n": 1.5, "l": [1]}'}}]}])
    block = render_tool_calls(r.messages[1].tool_calls)
    assert _parse([block]) == ("", [("f", {"s": "a b", "n": 1.5, "l": [1]})])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_streamed_parsing_equals_whole(cuts):
    assert _parse(_chunks(ANSWER, cuts)) == _parse([ANSWER])
    text = "think about it</think>The answer."
    whole = ReasoningParser(True).feed(text, final=True)
    p, r, c = ReasoningParser(True), "", ""
    parts = _chunks(text, cuts)
    for i, part in enumerate(parts):
        a, b = p.feed(part, final=i == len(parts) - 1)
        r, c = r + a, c + b
    assert (r, c) == whole == ("think about it", "The answer.")


# ---- tokens -> text ---------------------------------------------------------------------------------
SAMPLE = "def naïve(x):  # ünïcödé ✓ 🐍 — 数据\n    return x * 2\n"


def test_incremental_detokenization_keeps_utf8_whole():
    ids = TOK.encode(SAMPLE, add_special_tokens=False).ids
    d = IncrementalDetokenizer(TOK)
    pieces = [d.add(t) for t in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TOK.decode(ids) == SAMPLE
    assert any(p == "" for p in pieces[:-1])  # some tokens held part of a character back


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=40), st.sampled_from(
    ["ünïc", "✓ 🐍", "x * 2", "\n    return", "@@absent@@"]))
def test_stop_strings_any_grouping(sizes, stop):
    """Tokens grouped as MTP steps bring them: the text, the finish and the tokens counted do not depend on
    the grouping, the text stops right before the stop string, and what is released never runs past it."""
    ids = TOK.encode(SAMPLE, add_special_tokens=False).ids
    groups, i = [], 0
    for n in sizes:
        if i >= len(ids):
            break
        groups.append(ids[i:i + n])
        i += n
    if i < len(ids):
        groups.append(ids[i:])
    out = OutputText(TOK, [stop], {1}, skip_special_tokens=True)
    released = ""
    for k, g in enumerate(groups):
        released += out.add(g, "length" if k == len(groups) - 1 else None)
        assert SAMPLE.startswith(released)
        if out.done:
            break
    cut = SAMPLE.find(stop)
    if cut < 0:
        assert (released, out.finish_reason, out.num_tokens) == (SAMPLE, "length", len(ids))
    else:
        used = next(m for m in range(1, len(ids) + 1) if stop in TOK.decode(ids[:m]))
        assert (released, out.finish_reason, out.num_tokens) == (SAMPLE[:cut], "stop", used)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=60))
def test_a_chat_choice_streams_what_it_returns_whole(sizes):
    """Token ids of a thinking answer with tool calls, through a chat choice in MTP-sized groups: the
    deltas join to what the choice holds at the end, which is the whole text's parse; one finish reason."""
    answer = "Paris is in France</think>" + ANSWER
    ids = TOK.encode(answer, add_special_tokens=False).ids + [1]  # ... then EOS
    choice = Choice(0, OutputText(TOK, [], {1}, skip_special_tokens=False), ReasoningParser(True), ToolCallParser())
    groups, i = [], 0
    for n in itertools.cycle(sizes):
        if i >= len(ids):
            break
        groups.append(ids[i:i + n])
        i += n
    reasoning, content, calls, finishes = "", "", [], []
    for k, g in enumerate(groups):
        d = choice.consume(Update("0", g, "stop" if k == len(groups) - 1 else None))
        reasoning, content, calls = reasoning + d.reasoning, content + d.text, calls + d.tool_calls
        if d.finish_reason:
            finishes.append(d.finish_reason)
    assert finishes == ["tool_calls"] and choice.num_tokens == len(ids)
    assert (reasoning, content) == (choice.reasoning, choice.content) == ("Paris is in France", "I will look.")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == _parse([ANSWER])[1]
