"""Guards in front of every route, as pure ASGI middleware (BaseHTTPMiddleware would buffer streams
and hide client disconnects): Host check, API key, body-size cap, and the count of rejections.

They run outermost first in the order `build_app` adds them: rejections are counted for every
answer, a foreign Host is refused before the key is looked at, and a client without the key is
refused before a byte of its body is read.
"""
from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from iterserve.server.anthropic_protocol import anthropic_error_body, is_messages_path
from iterserve.server.protocol import error_body


def error_response(message: str, status_code: int, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
    """OpenAI's error shape, or Anthropic's for the Messages API's routes (`path`)."""
    if path is not None and is_messages_path(path):
        return JSONResponse(anthropic_error_body(message, status_code), status_code=status_code, headers=headers)
    return JSONResponse(error_body(message, status_code, param, code), status_code=status_code, headers=headers)


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def host_name(header: bytes) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostCheckMiddleware:
    def __init__(self, app, allowed: list[str]) -> None:
        self.app = app
        self.allowed = {h.lower().strip("[]") for h in allowed}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = _header(scope, b"host")
            if header is None or host_name(header) not in self.allowed:
                await error_response("Host header not allowed (see --allowed-hosts)", 400, code="invalid_host",
                                     path=scope.get("path"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Every route needs the key except /health (probes) and, when asked for, /metrics (scrapers):
    as 'Authorization: Bearer KEY' (OpenAI's clients) or 'x-api-key: KEY' (Anthropic's), on every
    route alike, since it is one secret either way and an Anthropic client also calls /v1/models.
    The scheme is case-insensitive (RFC 9110); the key is compared in constant time so that response
    timing does not reveal how much of a guess was right."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths

    def authorized(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def authorized_x_api_key(self, header: bytes | None) -> bool:
        return header is not None and hmac.compare_digest(header.strip(), self.key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in self.open_paths:
            header, x_api_key = _header(scope, b"authorization"), _header(scope, b"x-api-key")
            if not (self.authorized(header) or self.authorized_x_api_key(x_api_key)):
                msg = "missing API key" if header is None and x_api_key is None else "wrong API key"
                await error_response(f"{msg}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", 401,
                                     code="invalid_api_key", path=scope.get("path"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from receive(); FastAPI lets HTTPExceptions from body reading through unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes (--max-request-bytes)")


class BodyLimitMiddleware:
    """Refuses a body over `max_bytes` with 413: at once when Content-Length says so, otherwise as
    soon as the streamed (chunked) body passes the limit; never buffers more than the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        exc = BodyTooLarge(self.max_bytes)
        await error_response(exc.detail, 413, code="request_too_large", headers={"Connection": "close"},
                             path=scope.get("path"))(scope, receive, send)


class RejectionCounterMiddleware:
    """Calls `count(status)` for every error answer (>= 400) to a request the engine never admitted
    (the route marks admitted requests in scope state): 400, 401, 404, 413, 503 ... by status.
    /health's 503 is a probe's answer, not a refused request."""

    def __init__(self, app, count: Callable[[int], None], skip_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self.count = count
        self.skip_paths = skip_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.skip_paths:
            await self.app(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                if not scope.get("state", {}).get("admitted"):
                    self.count(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
