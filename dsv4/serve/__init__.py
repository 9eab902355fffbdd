"""``dsv4 serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn, with Prometheus metrics.

| module | what |
|---|---|
| ``launch.py`` | the command line (trtllm-serve's flags) -> settings -> the engine process -> uvicorn |
| ``app.py`` | the routes, request checks, streamed (SSE) and whole answers |
| ``guard.py`` | API key and request-size limit (an ASGI middleware) |
| ``protocol.py`` | request models (pydantic), OpenAI's error shape, response builders |
| ``loop.py`` | the engine loop: owns the engine, drains requests before every step, one message per step |
| ``host.py`` | where the loop runs: an engine process of its own (``dsv4 serve``), or a thread here |
| ``client.py`` | the HTTP side's end: submit / abort, step messages -> the requests' asyncio queues, metrics |
| ``messages.py`` | what the two sides send each other over their pipe |
| ``job.py`` | one HTTP request's choices in the engine, and what their tokens become |
| ``detokenizer.py`` | incremental detokenization (UTF-8 safe) and stop strings |
| ``chat.py`` | DeepSeek-V4's chat format (or the checkpoint's template) |
| ``parsers.py`` | reasoning and DSML tool-call parsing, streamed |
| ``metrics.py`` | prometheus_client metrics |
"""

from .app import build_app

__all__ = ["build_app"]
