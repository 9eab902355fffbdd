"""Reading a chat answer back: reasoning (before ``</think>``) and DSML tool calls, as the text streams in.

Both parsers are incremental and are also what the non-streamed answer goes through (fed the whole text at
once), so a streamed answer joins to exactly the non-streamed one. Each holds back the end of its input while
it could be the start of a marker (``</think>``, ``<｜DSML｜tool_calls>``), and releases it at the end.

The tool-call format is DeepSeek-V4's (see ``chat.py``): after the answer's text, ``\\n\\n`` then a
``<｜DSML｜tool_calls>`` block of ``<｜DSML｜invoke name="...">`` elements, each holding
``<｜DSML｜parameter name="..." string="true|false">value</｜DSML｜parameter>`` (string values as is, others as
JSON) or a JSON object. A call is handed out whole (name and arguments in one delta) once its invoke closes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .chat import DSML, THINK_END, TOOL_CALLS_END, TOOL_CALLS_START

_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.DOTALL)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is the start of ``marker`` (shorter than the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    """Thinking mode: the output starts inside the reasoning and leaves it at ``</think>``; chat mode: all of
    it is content."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """-> (reasoning released, content released)."""
        if not self.in_reasoning:
            return "", text
        self.buf += text
        i = self.buf.find(THINK_END)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(THINK_END):]
            self.buf, self.in_reasoning = "", False
            return reasoning, content
        keep = 0 if final else partial_suffix(self.buf, THINK_END)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, ""


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI's tool_calls carry it

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _arguments(body: str) -> str:
    """An invoke's body -> its arguments as a JSON object."""
    params = _PARAM.findall(body)
    if not params and body.strip().startswith("{"):
        try:
            value = json.loads(body)
            if isinstance(value, dict):
                return json.dumps(value, ensure_ascii=False)
        except json.JSONDecodeError:
            pass
    args = {}
    for name, is_str, value in params:
        if is_str == "true":
            args[name] = value
        else:
            try:
                args[name] = json.loads(value)
            except json.JSONDecodeError:
                args[name] = value  # not JSON after all: kept as the text the model wrote
    return json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """Content until a ``<｜DSML｜tool_calls>`` block, then the calls in it; text after the block is content.
    A block left open at the end is given back as content, so no text is lost."""

    _LEAD = "\n\n" + TOOL_CALLS_START  # the format puts a blank line before the block

    def __init__(self):
        self.mode = "text"  # "text" -> "calls" -> "after"
        self.buf = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """-> (content released, calls completed)."""
        self.buf += text
        content, calls = "", []
        if self.mode == "text":
            i = self.buf.find(TOOL_CALLS_START)
            if i < 0:
                keep = 0 if final else max(partial_suffix(self.buf, self._LEAD),
                                           partial_suffix(self.buf, TOOL_CALLS_START))
                content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return content, calls
            content = self.buf[:i].removesuffix("\n\n")
            self.buf, self.mode = self.buf[i + len(TOOL_CALLS_START):], "calls"
        if self.mode == "calls":
            while True:
                rest = self.buf.lstrip()
                if rest.startswith(TOOL_CALLS_END):
                    self.buf, self.mode = rest[len(TOOL_CALLS_END):], "after"
                    break
                m = _INVOKE.match(rest)
                if m is None:
                    break
                calls.append(ParsedToolCall(f"call_{uuid.uuid4().hex[:24]}", m.group(1), _arguments(m.group(2))))
                self.buf = rest[m.end():]
            if final and self.mode == "calls" and self.buf.strip():
                content += TOOL_CALLS_START + self.buf  # an unfinished block: the raw text, not a guess
                self.buf = ""
        if self.mode == "after":
            content += self.buf
            self.buf = ""
        self.num_calls += len(calls)
        return content, calls
