"""What every request passes before the routes: the API key (``--api_key``: ``Authorization: Bearer KEY`` on
``/v1/*``, ``/tokenize`` and ``/detokenize``; ``/health``, ``/version`` and ``/metrics`` stay open, as in vLLM)
and the size limit on request bodies (413 past ``--max_request_bytes``, counted as the body arrives, so a body
without a Content-Length cannot slip past it). Refusals answer with OpenAI's error JSON.

A plain ASGI middleware: the body is read here (the route would read it anyway) and handed on whole; after
it, the route's ``receive`` is the server's, so a client's disconnect still reaches the handlers.
"""

from __future__ import annotations

import hmac
import json

from .protocol import error_body

OPEN_PATHS = ("/health", "/version", "/metrics")


class Guard:
    def __init__(self, app, api_key: str | None = None, max_request_bytes: int = 8 << 20, on_refuse=None):
        self.app = app
        self.api_key = api_key
        self.max_bytes = max_request_bytes
        self.on_refuse = on_refuse

    async def _refuse(self, send, status: int, message: str, type: str, code: str | None = None) -> None:
        if self.on_refuse is not None:
            self.on_refuse(status)
        body = json.dumps(error_body(message, type=type, code=code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return True
        auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await self._refuse(send, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                      "authentication_error", "invalid_api_key")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        too_big = (f"the request body is larger than this server's limit of {self.max_bytes} bytes"
                   " (--max_request_bytes)")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, 413, too_big, "invalid_request_error", "request_too_large")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(send, 413, too_big, "invalid_request_error", "request_too_large")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
