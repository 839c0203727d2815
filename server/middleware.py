"""Pure ASGI middleware: body size limit and API-key check.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched; both checks answer before the body is parsed.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_body
from server.tenants import Tenant


async def _send_error(send: Send, status: int, message: str, code: str,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """413 for a declared Content-Length over the limit, and for a chunked body that
    grows past it (raised from `receive`, which FastAPI turns into our 413 handler)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    return await _send_error(send, 400, "bad Content-Length", "bad_request")
                if declared > self.max_bytes:
                    return await _send_error(
                        send, 413, f"request body of {declared} bytes exceeds the limit of "
                        f"{self.max_bytes} bytes", "request_too_large",
                        [(b"connection", b"close")])
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, f"request body exceeds the limit of "
                                             f"{self.max_bytes} bytes")
            return msg

        await self.app(scope, limited_receive, send)


def _protected(path: str) -> bool:
    """The API (/v1/*, /tokenize, /detokenize) needs a key; probes, /metrics and
    /version do not. vLLM leaves /tokenize open; here it is API work like any other, and
    clients that use it (through the `openai` client's key) send the key anyway."""
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize")


class APIKeyAuth:
    """`Authorization: Bearer <key>` on the API (`_protected`); probes and /metrics stay
    open so load balancers and Prometheus need no secret.

    With several keys, each is a tenant: the matching key's `Tenant` is recorded in
    `scope["state"]["tenant"]` (`request.state.tenant`) for the handlers. Every key is
    compared (constant time each), so timing does not tell which one came close.
    """

    def __init__(self, app: ASGIApp, tenants: Sequence[Tenant]) -> None:
        self.app = app
        self.keys = [(t.key.encode(), t) for t in tenants]

    def match(self, token: bytes) -> Tenant | None:
        found = None
        for key, tenant in self.keys:
            if hmac.compare_digest(token, key) and found is None:
                found = tenant
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (not self.keys or scope["type"] != "http"
                or not _protected(scope.get("path", ""))
                or scope.get("method") == "OPTIONS"):
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                auth = v
        scheme, _, token = auth.partition(b" ")
        tenant = self.match(token.strip()) if scheme.lower() == b"bearer" else None
        if tenant is None:
            return await _send_error(send, 401, "Incorrect or missing API key; send "
                                     "'Authorization: Bearer <key>'", "invalid_api_key",
                                     [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class HTTPMetrics:
    """Count responses by route and status code; unknown paths share one label value so
    a scanner cannot blow up the series count."""

    def __init__(self, app: ASGIApp, counter: object, routes: set[str],
                 prefixes: dict[str, str] | None = None) -> None:
        self.app = app
        self.counter = counter
        self.routes = routes
        self.prefixes = prefixes or {}  # path prefix -> its label (`/v1/models/{model}`)

    def route(self, path: str) -> str:
        if path in self.routes:
            return path
        for prefix, label in self.prefixes.items():
            if path.startswith(prefix):
                return label
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = self.route(scope.get("path", ""))

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route, str(message["status"])).inc()  # type: ignore[attr-defined]
            await send(message)

        await self.app(scope, receive, counting_send)
