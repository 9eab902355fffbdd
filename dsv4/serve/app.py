"""The HTTP API (FastAPI): OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, plus
``/health``, ``/version``, ``/metrics``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes).

``build_app(engine, ...)`` serves an ``EngineProcess`` (``launch.py``'s: the engine in a process of its own)
or an ``LLM`` already built in this process (its engine loop then runs in a thread here). The handlers check
each request (400 with OpenAI's error JSON for anything wrong in it), turn it into engine
requests (one per choice), and answer from the engine loop's events, streamed as server-sent events or whole.
A client that goes away has its requests aborted in the engine, wherever they are.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.sampling_params import MAX_LOGPROBS, SamplingParams
from .chat import ChatEncoder, chat_options
from .detokenizer import OutputText
from .client import EngineClient
from .guard import Guard
from .host import EngineProcess, EngineThread
from .job import Choice, Job
from .metrics import CONTENT_TYPE, ServerMetrics
from .parsers import ReasoningParser, ToolCallParser
from .protocol import (MAX_N, MAX_STOP_STRINGS, ApiError, ChatCompletionRequest, CompletionRequest,
                       DetokenizeRequest, NamedToolChoice, StreamChunks, TokenizeRequest, error_body, new_id, now,
                       response_body, sse, usage)

log = logging.getLogger("dsv4.serve")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20


class ServerState:
    """What the handlers share: the engine (a client of its loop), the tokenizer, the chat encoder, the
    metrics. ``host``: an ``EngineProcess`` or ``EngineThread``."""

    def __init__(self, host, model_name: str, chat_template: str | None = None):
        self.model_name = model_name
        self.tokenizer = host.tokenizer
        info = host.info
        self.max_seq_len = info.max_seq_len
        self.vocab_size = info.vocab_size
        self.eos_token_id = info.eos_token_id
        self.metrics = ServerMetrics(model_name)
        self.metrics.m(self.metrics.engine).info({"pid": str(info.pid), "server_pid": str(os.getpid())})
        self.engine = EngineClient(host, self.metrics)
        self.encoder = ChatEncoder(chat_template)


# ---- request -> engine requests ---------------------------------------------------------------------
def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(f"The model `{model}` does not exist; this server serves `{state.model_name}`",
                       param="model", code="model_not_found")


def _need_tokenizer(state: ServerState, what: str) -> None:
    if state.tokenizer is None:
        raise ApiError(f"this model has no tokenizer (no tokenizer.json in the checkpoint): {what} needs one; send"
                       " token ids as the prompt of /v1/completions instead")


def _encode(state: ServerState, text: str, param: str, **kw) -> list[int]:
    """The token ids of ``text``; a 400 naming ``param`` for a string JSON allows but Unicode does not (a lone
    surrogate escape such as ``"\\ud800"``), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"{param} is not valid Unicode text: it holds a lone surrogate ({text[e.start]!r}); send"
                       " whole characters (a surrogate pair, or the character itself)", param=param) from None
    return state.tokenizer.encode(text, **kw).ids


def _refuse_unsupported(body) -> None:
    """Options this server does not honour: a 400 naming them, never silently ignored."""
    if body.presence_penalty or body.frequency_penalty:
        raise ApiError("presence_penalty and frequency_penalty are not supported by this server",
                       param="presence_penalty" if body.presence_penalty else "frequency_penalty")
    if body.logit_bias:
        raise ApiError("logit_bias is not supported by this server", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise ApiError("stream_options can only be given when stream is true", param="stream_options")
    if not 1 <= body.n <= MAX_N:
        raise ApiError(f"n must be in [1, {MAX_N}], got {body.n}", param="n")


def _stops(body) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    if any(s == "" for s in stop):
        raise ApiError("stop strings must not be empty", param="stop")
    return stop


def _params(state: ServerState, body, max_tokens: int | None, prompt_len: int, default_max: int | None,
            choice: int, logprobs: int | None) -> SamplingParams:
    """One choice's SamplingParams, after checking the prompt and max_tokens against max_seq_len.
    ``logprobs``: None, or the top logprobs to return with each token (SamplingParams.logprobs)."""
    L = state.max_seq_len
    if prompt_len >= L:
        raise ApiError(f"This model's maximum context length is {L} tokens; the prompt has {prompt_len} tokens"
                       " (it must leave room for at least one generated token)", param="messages"
                       if isinstance(body, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else L - prompt_len
    elif max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if prompt_len + max_tokens > L:
        raise ApiError(f"This model's maximum context length is {L} tokens. However, you requested"
                       f" {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the"
                       " completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    stop_ids = body.stop_token_ids or []
    bad = [t for t in stop_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ApiError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})",
                       param="stop_token_ids")
    seed = body.seed + choice if body.seed is not None else None  # choice j of n: its own draw, reproducible
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=seed,
                              stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos, detokenize=False,
                              logprobs=logprobs)
    except ValueError as e:
        name = str(e).split()[0].removeprefix("SamplingParams.")
        raise ApiError(str(e).replace("SamplingParams.", ""), param=name) from None


def _output_text(state: ServerState, body, sp: SamplingParams, skip_special: bool) -> OutputText:
    stop_ids = set(sp.stop_token_ids)
    if not sp.ignore_eos and state.eos_token_id is not None:
        stop_ids.add(state.eos_token_id)
    return OutputText(state.tokenizer, _stops(body), stop_ids, skip_special, body.include_stop_str_in_output)


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        texts, ids = [p], None
    elif not p:
        raise ApiError("prompt is empty", param="prompt")
    elif isinstance(p[0], str):
        texts, ids = p, None
    elif isinstance(p[0], int):
        texts, ids = None, [p]
    else:
        texts, ids = None, p
    if texts is not None:
        _need_tokenizer(state, "a text prompt")
        ids = [_encode(state, t, "prompt") for t in texts]
    for one in ids:
        if not one:
            raise ApiError("a prompt is empty (no tokens)", param="prompt")
        bad = [t for t in one if not 0 <= t < state.vocab_size]
        if bad:
            raise ApiError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})",
                           param="prompt")
    return ids


# ---- logprobs in OpenAI's shapes ---------------------------------------------------------------------
def _token_text(state: ServerState, token_id: int) -> str:
    """A token's own text (special tokens included), as vLLM shows tokens in logprobs; a token holding part of
    a UTF-8 character shows U+FFFD."""
    return state.tokenizer.decode([token_id], skip_special_tokens=False)


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # (as vLLM: JSON has no -Infinity)


def _completion_logprobs(state: ServerState, entries: list[tuple[int, dict]], offset: int) -> tuple[dict, int]:
    """The legacy completions shape for these (token, logprobs) entries, their text starting at character
    ``offset`` of the choice; returns it and the offset after them. ``top_logprobs``: the chosen token and the
    top n (up to n + 1 entries, as OpenAI's legacy API)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for t, lps in entries:
        text = _token_text(state, t)
        tokens.append(text)
        token_logprobs.append(_finite(lps[t]))
        top.append({_token_text(state, k): _finite(v) for k, v in lps.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def _chat_logprob(state: ServerState, token_id: int, logprob: float) -> dict:
    text = _token_text(state, token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(state: ServerState, entries: list[tuple[int, dict]], top_n: int) -> dict:
    """The chat shape: per token its logprob and the ``top_n`` most likely tokens, best first."""
    content = []
    for t, lps in entries:
        best = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**_chat_logprob(state, t, lps[t]),
                        "top_logprobs": [_chat_logprob(state, k, v) for k, v in best]})
    return {"content": content}


# ---- answering --------------------------------------------------------------------------------------
async def _until_disconnect(request: Request, work) -> bool:
    """Run ``work`` (a coroutine); False when the client went away first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)

    async def gone():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises what the work raised
            return True
        return False
    finally:
        for t in (task, watch):
            t.cancel()


def _stream(state: ServerState, job: Job, chunks: StreamChunks, chunk_choice, first_chunks, include_usage: bool):
    """The SSE body: each delta as a chunk, exactly one finish_reason per choice, then the usage chunk (when
    asked for) and ``[DONE]``. However it ends (finished, client gone, error) the job is closed."""

    async def body():
        try:
            for ch in first_chunks:
                yield chunks([ch])
            try:
                async for c, d in job.events():
                    yield chunks([chunk_choice(c, d)])
            except ApiError as e:
                yield sse(e.body())
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                yield chunks.usage(usage(job.num_prompt_tokens, job.num_completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            job.close()
            job.observe(state.metrics)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _run_whole(state: ServerState, job: Job, request: Request) -> bool:
    try:
        return await _until_disconnect(request, job.run())
    finally:
        job.close()
        job.observe(state.metrics)


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    _check_model(state, body.model)
    _refuse_unsupported(body)
    if body.echo:
        raise ApiError("echo is not supported by this server", param="echo")
    if body.suffix:
        raise ApiError("suffix is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError("best_of other than n is not supported by this server", param="best_of")
    prompts = _completion_prompts(state, body)
    if len(prompts) * body.n > MAX_N:
        raise ApiError(f"{len(prompts)} prompts x n={body.n} choices: at most {MAX_N}", param="n")
    skip = True if body.skip_special_tokens is None else body.skip_special_tokens
    if state.tokenizer is None:
        raise ApiError("this model has no tokenizer: completions need one to return text")
    choices = []
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            sp = _params(state, body, body.max_tokens, len(ids), 16, j, body.logprobs)
            choices.append((p, sp, Choice(len(choices), _output_text(state, body, sp, skip))))
    rid, created = new_id("cmpl"), now()
    job = Job(state.engine, rid, prompts, choices)
    job.start()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = StreamChunks("text_completion", rid, created, state.model_name, include_usage)
        offsets = [0] * len(choices)  # per choice: where the next token's text starts (text_offset)

        def chunk_choice(c, d):
            logprobs = None
            if d.logprobs:
                logprobs, offsets[c.index] = _completion_logprobs(state, d.logprobs, offsets[c.index])
            return {"index": c.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}

        return _stream(state, job, chunks, chunk_choice, [], include_usage)
    if not await _run_whole(state, job, request):
        return Response(status_code=499)  # the client is gone; nobody reads this
    out = response_body("text_completion", rid, created, state.model_name, [
        {"index": c.index, "text": c.content,
         "logprobs": _completion_logprobs(state, c.logprobs, 0)[0] if body.logprobs is not None else None,
         "finish_reason": c.finish_reason} for c in job.choices])
    out["usage"] = usage(job.num_prompt_tokens, job.num_completion_tokens)
    return JSONResponse(out)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    _check_model(state, body.model)
    _refuse_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise ApiError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs")
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    _need_tokenizer(state, "chat")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError("give max_completion_tokens or max_tokens, not two different values",
                       param="max_completion_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    opts = chat_options(body.chat_template_kwargs, body.reasoning_effort)
    use_tools = bool(body.tools) and body.tool_choice != "none"
    if body.tool_choice not in (None, "none", "auto") and not body.tools:
        raise ApiError("tool_choice names a tool but no tools were given", param="tool_choice")
    if isinstance(body.tool_choice, NamedToolChoice):
        named, given = body.tool_choice.function.get("name"), [t.function.name for t in body.tools]
        if named not in given:
            raise ApiError(f"tool_choice names the function {named!r}, which is not in tools ({', '.join(given)});"
                           " name one of them, or use 'auto'", param="tool_choice")
    text = state.encoder.encode(body.messages, opts, body.tools if use_tools else None, body.response_format,
                                body.chat_template_kwargs)
    ids = _encode(state, text, "messages", add_special_tokens=False)
    # special tokens stay in the text by default: </think> and the DSML markers are what the parsers read
    skip = False if body.skip_special_tokens is None else body.skip_special_tokens
    choices = []
    for j in range(body.n):
        sp = _params(state, body, max_tokens, len(ids), None, j, top_n)
        choices.append((0, sp, Choice(j, _output_text(state, body, sp, skip), ReasoningParser(opts.thinking),
                                      ToolCallParser() if use_tools else None)))
    rid, created = new_id("chatcmpl"), now()
    job = Job(state.engine, rid, [ids], choices)
    job.start()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = StreamChunks("chat.completion.chunk", rid, created, state.model_name, include_usage)

        def chunk_choice(c, d):
            delta = {}
            if d.reasoning:
                delta["reasoning_content"] = delta["reasoning"] = d.reasoning
            if d.text:
                delta["content"] = d.text
            if d.tool_calls:
                first = len(c.tool_calls) - len(d.tool_calls)
                delta["tool_calls"] = [tc.as_openai(first + k) for k, tc in enumerate(d.tool_calls)]
            logprobs = _chat_logprobs(state, d.logprobs, top_n) if d.logprobs else None
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": d.finish_reason}

        first = [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for j in range(body.n)]
        return _stream(state, job, chunks, chunk_choice, first, include_usage)
    if not await _run_whole(state, job, request):
        return Response(status_code=499)
    out = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name, "choices": []}
    for c in job.choices:
        msg = {"role": "assistant", "content": c.content if (c.content or not c.tool_calls) else None,
               "reasoning_content": c.reasoning or None, "reasoning": c.reasoning or None}
        if c.tool_calls:
            msg["tool_calls"] = [tc.as_openai() for tc in c.tool_calls]
        logprobs = _chat_logprobs(state, c.logprobs, top_n) if top_n is not None else None
        out["choices"].append({"index": c.index, "message": msg, "logprobs": logprobs,
                               "finish_reason": c.finish_reason})
    out["usage"] = usage(job.num_prompt_tokens, job.num_completion_tokens)
    return JSONResponse(out)


# ---- the app ----------------------------------------------------------------------------------------
def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    param = ".".join(loc) or None
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    return (f"{param}: {e.get('msg')}" if param else str(e.get("msg"))) + more, param


def build_app(engine, model_name: str = "mini", *, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``: an ``EngineProcess`` already started, or an ``LLM`` built in this
    process (its engine loop then runs in a thread). The app stops the engine loop (and its process) when it
    stops."""
    host = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
    state = ServerState(host, model_name, chat_template)

    @asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="dsv4", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.dsv4 = state
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes,
                       on_refuse=lambda status: state.metrics.m(state.metrics.http_errors, status=str(status)).inc())

    def err(status: int, body: dict) -> JSONResponse:
        state.metrics.m(state.metrics.http_errors, status=str(status)).inc()
        return JSONResponse(body, status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return err(exc.status, exc.body())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return err(400, error_body(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return err(exc.status_code, error_body(str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):
        log.exception("internal error")
        return err(500, error_body(f"internal server error: {type(exc).__name__}", type="server_error"))

    @app.get("/health")
    async def health():
        state.engine.check_alive()  # (a 503 otherwise)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": now(),
                                            "owned_by": "dsv4", "root": state.model_name,
                                            "max_model_len": state.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(state, body.model)
        _need_tokenizer(state, "tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError("give either prompt or messages", param="prompt")
        if body.messages is not None:
            opts = chat_options(body.chat_template_kwargs, None)
            text = state.encoder.encode(body.messages, opts, body.tools, template_kwargs=body.chat_template_kwargs)
            ids = _encode(state, text, "messages", add_special_tokens=False)
        else:
            ids = _encode(state, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(state, body.model)
        _need_tokenizer(state, "detokenize")
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise ApiError(f"token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app
