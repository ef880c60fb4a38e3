"""`iterserve serve` inside the test process, for the tests of the API contract.

The app and its AsyncEngine are wired by the same code as `iterserve serve` (cli_serve.build_server,
from the same command line), over a model the session has already loaded. There is no socket and no
subprocess: httpx's ASGITransport hands each request to the app. The app lives on one event loop
that runs in a thread of its own for as long as the server is open, because the AsyncEngine delivers
outputs to the loop it was started on; synchronous tests, the official openai client and asyncio
code (through `run`) all reach that loop. Entering starts the app's lifespan (the engine thread and
its warm-up) as uvicorn would; leaving stops it and joins the thread.

What this cannot show, and the tests marked `slow` show over real HTTP against an `iterserve serve`
process: a client that drops its connection mid-stream (ASGITransport buffers a whole response
before it returns it), signals, and the command line's start-up.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx

from iterserve.cli import build_parser
from iterserve.server.cli_serve import build_server, resolve_args

T = TypeVar("T")


class AppServer:
    def __init__(self, serve_argv: list[str], loaded) -> None:
        self.args = resolve_args(build_parser().parse_args(["serve", *serve_argv]))
        self.engine, self.app = build_server(self.args, loaded)
        self.base_url = f"http://{self.args.host}:{self.args.port}"  # the Host a real client would send
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="app-server-loop", daemon=True)
        self._lifespan = self.app.router.lifespan_context(self.app)

    def __enter__(self) -> "AppServer":
        self._thread.start()
        self.run(self._lifespan.__aenter__())
        assert self.engine.ready.wait(60), "the engine did not warm up"
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.run(self._lifespan.__aexit__(None, None, None))
            assert not self.engine.alive
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        """Runs a coroutine on the server's loop (where `async_client` may be used) and waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def async_client(self, **kw) -> httpx.AsyncClient:
        """A client for coroutines given to `run`."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(self.app), base_url=self.base_url, **kw)

    def client(self, **kw) -> httpx.Client:
        """A synchronous client, for plain tests and for `openai.OpenAI(http_client=...)`."""
        return httpx.Client(transport=_OnServerLoop(self), base_url=self.base_url, **kw)


class _OnServerLoop(httpx.BaseTransport):
    """Sends each request through ASGITransport on the server's loop and waits for the whole reply."""

    def __init__(self, server: AppServer) -> None:
        self.server = server
        self.asgi = httpx.ASGITransport(server.app)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def send() -> tuple[int, list[tuple[bytes, bytes]], bytes]:
            response = await self.asgi.handle_async_request(request)
            return response.status_code, response.headers.raw, await response.aread()

        status, headers, body = self.server.run(send())
        return httpx.Response(status, headers=headers, content=body)
