"""``dsv4 serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn, with Prometheus metrics.

| module | what |
|---|---|
| ``launch.py`` | the command line (trtllm-serve's flags) -> settings -> ``LLM`` -> uvicorn |
| ``app.py`` | the routes, request checks, streamed (SSE) and whole answers |
| ``guard.py`` | API key and request-size limit (an ASGI middleware) |
| ``protocol.py`` | request models (pydantic), OpenAI's error shape, response builders |
| ``loop.py`` | the engine loop: one thread owns the engine; handlers feed it through queues |
| ``job.py`` | one HTTP request's choices in the engine, and what their tokens become |
| ``detokenizer.py`` | incremental detokenization (UTF-8 safe) and stop strings |
| ``chat.py`` | DeepSeek-V4's chat format (or the checkpoint's template) |
| ``parsers.py`` | reasoning and DSML tool-call parsing, streamed |
| ``metrics.py`` | prometheus_client metrics |
"""

from .app import build_app

__all__ = ["build_app"]
