"""Chat messages -> prompt text, in DeepSeek-V4's chat format (or the checkpoint's own template when it ships one).

The format (DeepSeek-V4's reference encoder, ``encoding/encoding_dsv4.py`` of the deepseek-ai/DeepSeek-V4
checkpoints, as carried by SGLang in ``python/sglang/srt/entrypoints/openai/encoding_dsv4.py``)::

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ...]<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>                          <- thinking mode: the model writes its
                                                                     reasoning, then </think>, then the answer

- chat mode ends the prompt with ``</think>`` (no reasoning); thinking mode with ``<think>``. Earlier assistant
  turns keep their reasoning only when tools are in play (otherwise it is dropped, as the reference does).
- ``reasoning_effort="max"`` puts a fixed instruction before the first message (thinking mode only).
- tool results have no role of their own: consecutive ``tool`` messages become one user turn of
  ``<tool_result>...</tool_result>`` blocks (in the order of the assistant's calls).
- an assistant's tool calls follow its text as a DSML block (``parsers.py`` reads the model's)::

      \\n\\n<｜DSML｜tool_calls>
      <｜DSML｜invoke name="get_weather">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

A checkpoint's own Jinja template (``chat_template`` in ``tokenizer_config.json`` or a ``chat_template.jinja``
file) wins over the built-in format; it renders in a sandbox with HF's variables (``messages``, ``tools``,
``add_generation_prompt``, ``bos_token``, ``eos_token``) plus the request's ``chat_template_kwargs``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .protocol import ApiError, ChatMessage, ResponseFormat, Tool

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root"
    " cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial"
    " scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside \
{think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

EFFORTS = {"none": None, "minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max",
           "max": "max"}


@dataclass(frozen=True)
class ChatOptions:
    """How one request's conversation is encoded and how its output is read back."""

    thinking: bool = False
    reasoning_effort: str | None = None  # None, "high" or "max" (the reference's three levels)


def chat_options(kwargs: dict | None, reasoning_effort: str | None) -> ChatOptions:
    """From ``chat_template_kwargs`` ({"thinking" | "enable_thinking": bool, "reasoning_effort": str}) and the
    request's own ``reasoning_effort``. ``reasoning_effort="none"`` turns thinking off."""
    kwargs = kwargs or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
    if not isinstance(thinking, bool):
        raise ApiError(f"chat_template_kwargs.thinking must be true or false, got {thinking!r}",
                       param="chat_template_kwargs")
    effort = kwargs.get("reasoning_effort", reasoning_effort)
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise ApiError(f"reasoning_effort {effort!r}: use one of {', '.join(EFFORTS)}", param="reasoning_effort")
        if effort == "none":
            thinking = False
        effort = EFFORTS[effort]
    return ChatOptions(thinking=thinking, reasoning_effort=effort if thinking else None)


def _text(msg: ChatMessage) -> str:
    """A message's text: a string, or the text parts of a list (other parts are refused)."""
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for p in msg.content:
        if p.type != "text" or p.text is None:
            raise ApiError(f"message content part of type {p.type!r}: this server takes text only",
                           param="messages")
        parts.append(p.text)
    return "".join(parts)


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tool_calls(calls) -> str:
    """An assistant's tool calls as the DSML block that follows its text."""
    invokes = []
    for c in calls:
        try:
            args = json.loads(c.function.arguments or "{}")
        except json.JSONDecodeError:
            raise ApiError(f"tool call {c.function.name!r}: arguments are not JSON: {c.function.arguments!r:.80}",
                           param="messages") from None
        if not isinstance(args, dict):
            raise ApiError(f"tool call {c.function.name!r}: arguments must be a JSON object", param="messages")
        params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items()]
        invokes.append(f'<{DSML}invoke name="{c.function.name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def render_tools(tools: list[Tool]) -> str:
    schemas = "\n".join(_json(t.function.model_dump(exclude_none=True)) for t in tools)
    return TOOLS_SECTION.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def _turns(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the reference's turns: a run of ``tool`` messages (and user text right after them)
    becomes one user turn of blocks, its tool results ordered by the calls of the assistant turn before."""
    turns: list[dict] = []
    for m in messages:
        merged = bool(turns) and turns[-1]["role"] == "user" and turns[-1]["blocks"] is not None
        if m.role == "tool":
            block = ("tool", m.tool_call_id or "", _text(m))
            if merged:
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "text": "", "blocks": [block]})
            continue
        if m.role == "user" and merged:
            turns[-1]["blocks"].append(("text", "", _text(m)))
            continue
        turns.append({"role": m.role, "text": _text(m), "blocks": None, "msg": m,
                      "order": {c.id: i for i, c in enumerate(m.tool_calls or []) if c.id}})
    for i, t in enumerate(turns):
        if t["blocks"] is not None:
            order = turns[i - 1].get("order", {}) if i else {}
            tools = sorted((b for b in t["blocks"] if b[0] == "tool"), key=lambda b: order.get(b[1], 0))
            it = iter(tools)
            t["blocks"] = [next(it) if b[0] == "tool" else b for b in t["blocks"]]
    return turns


def encode_dsv4(messages: list[ChatMessage], opts: ChatOptions, tools: list[Tool] | None = None,
                response_format: ResponseFormat | None = None) -> str:
    """The prompt text for a conversation, ending where the assistant's next turn starts."""
    turns = _turns(messages)
    extra = ""
    if tools:
        extra += "\n\n" + render_tools(tools)
    if response_format is not None and response_format.type != "text":
        schema = response_format.json_schema if response_format.json_schema is not None else {"type": "object"}
        extra += "\n\n" + RESPONSE_FORMAT.format(schema=_json(schema))
    if extra:  # tools and the response format ride on the system message (one is made when there is none)
        if turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "text": "", "blocks": None})
        turns[0]["text"] += extra
    last_user = max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)
    keep_reasoning = bool(tools)  # with tools every turn keeps its reasoning (the reference's rule)
    out = [BOS]
    if opts.thinking and opts.reasoning_effort == "max":
        out.append(EFFORT_MAX_PREFIX)
    for i, t in enumerate(turns):
        role = t["role"]
        if role == "system":
            out.append(t["text"])
        elif role in ("user", "developer"):
            if t["blocks"] is not None:
                body = "\n\n".join(f"<tool_result>{text}</tool_result>" if kind == "tool" else text
                                   for kind, _, text in t["blocks"])
            else:
                body = t["text"]
            out.append(USER + body)
        elif role == "assistant":
            m = t["msg"]
            reasoning = ""
            if opts.thinking and (keep_reasoning or i > last_user):
                reasoning = (m.reasoning_content or m.reasoning or "") + THINK_END
            calls = render_tool_calls(m.tool_calls) if m.tool_calls else ""
            out.append(reasoning + t["text"] + calls + EOS)
        nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if role in ("user", "developer") and nxt in (None, "assistant"):
            thinks = opts.thinking and (keep_reasoning or i >= last_user)
            out.append(ASSISTANT + (THINK_START if thinks else THINK_END))
    if turns[-1]["role"] == "assistant":
        raise ApiError("the last message is the assistant's: end the conversation with a user or tool message",
                       param="messages")
    return "".join(out)


# ---- a checkpoint's own template ---------------------------------------------------------------------
def load_chat_template(checkpoint_dir: str | None) -> str | None:
    """The checkpoint's Jinja chat template, or None (then the built-in DeepSeek-V4 format is used)."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return None
    path = os.path.join(checkpoint_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(checkpoint_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError as e:  # (not JSON, not UTF-8)
            raise ValueError(f"{path} is not valid JSON ({e}); fix it or give --chat_template") from None
        tmpl = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(tmpl, list):  # HF's named templates: the default one
            tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"),
                        None)
        if isinstance(tmpl, str) and tmpl.strip():
            return tmpl
    return None


class ChatEncoder:
    """The conversation -> prompt text step of one served model."""

    def __init__(self, template: str | None = None):
        self.template = template
        self._compiled = None
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_from_template
            env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
            from jinja2 import TemplateSyntaxError

            try:
                self._compiled = env.from_string(template)
            except TemplateSyntaxError as e:
                raise ValueError(f"the chat template is not valid Jinja: {e.message} (line {e.lineno})") from None

    @property
    def source(self) -> str:
        return "the checkpoint's chat template" if self.template is not None else "DeepSeek-V4's chat format"

    def encode(self, messages: list[ChatMessage], opts: ChatOptions, tools: list[Tool] | None = None,
               response_format: ResponseFormat | None = None, template_kwargs: dict | None = None) -> str:
        if self._compiled is None:
            return encode_dsv4(messages, opts, tools, response_format)
        from jinja2 import TemplateError

        ctx = dict(template_kwargs or {})
        ctx.update(messages=[m.model_dump(exclude_none=True) for m in messages],
                   tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                   add_generation_prompt=True, bos_token=BOS, eos_token=EOS)
        try:
            return self._compiled.render(**ctx)
        except ApiError:
            raise
        except (TemplateError, TypeError, ValueError) as e:
            raise ApiError(f"the model's chat template failed on these messages: {e}", param="messages") from None


def _raise_from_template(message: str):
    raise ApiError(f"the model's chat template refused these messages: {message}", param="messages")
