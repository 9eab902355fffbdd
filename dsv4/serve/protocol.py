"""The OpenAI wire format: request bodies as pydantic models (validated strictly: ``"5"`` is not an integer),
the error shape every failure answers with, and the response / stream-chunk builders.

Requests are checked here for what can be checked without the model (types, ranges, unsupported options);
``app.py`` checks what needs it (the model's name, the prompt's length against ``max_seq_len``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 64  # choices per request (n x prompts); more is a 400, not a queue that never drains
MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """A request the server refuses: answered as OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    # strict: a string is not coerced into a number; unknown fields are ignored, as vLLM and OpenAI do
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share (OpenAI's names, plus vLLM's extensions top_k, stop_token_ids, ...)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(kind: str, rid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None,
                  with_usage_field: bool = False) -> dict:
    """An OpenAI response object or stream chunk: ``kind`` is its "object" ("text_completion",
    "chat.completion.chunk"); ``usage`` only where the stream asked for it (``include_usage``)."""
    out = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if with_usage_field:
        out["usage"] = usage_
    return out


_JSON = json.JSONEncoder(ensure_ascii=False)  # (json.dumps with an option builds a new encoder on every call)


def sse(obj) -> str:
    """One server-sent event: ``data: <obj as JSON>`` and a blank line."""
    return f"data: {_JSON.encode(obj)}\n\n"


class StreamChunks:
    """The events of one stream: ``chunks(choices)`` is ``sse(response_body(kind, rid, created, model, choices,
    None, with_usage_field))`` character for character, with the fields every chunk repeats encoded once (a
    stream writes a chunk per engine step and choice)."""

    def __init__(self, kind: str, rid: str, created: int, model: str, with_usage_field: bool = False):
        self._fields = (kind, rid, created, model)
        self.with_usage_field = with_usage_field
        empty = _JSON.encode(response_body(kind, rid, created, model, [], None, with_usage_field))
        cut = empty.rindex('"choices": []') + len('"choices": [')  # (the last: the fields before it are strings)
        self._head, self._tail = "data: " + empty[:cut], empty[cut:] + "\n\n"

    def __call__(self, choices: list[dict]) -> str:
        return self._head + ", ".join(map(_JSON.encode, choices)) + self._tail

    def usage(self, usage_: dict) -> str:
        """The last chunk of a stream that asked for usage: no choices, the usage."""
        return sse(response_body(*self._fields, [], usage_, self.with_usage_field))
