"""`vllm bench serve` with one new HTTP connection per request, and llama.cpp's keep-alive comments
skipped; run by the vLLM install's Python. Two mends to the client, both for llama.cpp's server:

Connections. The client keeps its connections alive and reuses them when a request ends and the
next one of the same slot starts. llama.cpp's server (`llama-server`) answers a streamed completion
with `Keep-Alive: timeout=5, max=100` and then closes the connection, so the reused connection fails
at refill ("Cannot write to closing transport") although the server's log shows the request served.
Two streamed requests in a row on one aiohttp connection reproduce it on an idle host. A fresh
connection per request costs about a millisecond on loopback, against seconds a request, and every
system in a comparison is measured the same way.

Comments. While a request waits for its first token, llama-server sends an SSE comment (`:` and a
blank line) every 30 s. The client strips each read before parsing, so a read holding only that
comment leaves a bare `:` in its buffer with no blank line to end it; every later event is glued
onto it and skipped with it as a comment. A request whose first token took over 30 s then reads as
empty or failed ("Never received a valid chunk") although it streamed all its tokens: at 16
concurrent on a 2-core host, most of llama.cpp's refill wave. A bare comment read at a message
boundary is dropped here before the client's parser sees it; everything else reaches it unchanged.

    $PEERS/vvenv/bin/python benchmarks/peers/vllm_bench_fresh.py bench serve ...   # vllm's arguments
"""
import sys
from typing import Any, Callable


def fresh_connections(connector_init: Callable[..., None]) -> Callable[..., None]:
    """Wraps aiohttp.TCPConnector.__init__: every connector it builds closes each connection after
    its response (force_close), whatever the caller asked."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("keepalive_timeout", None)  # aiohttp refuses a keep-alive timeout beside force_close
        kwargs["force_close"] = True
        connector_init(self, *args, **kwargs)

    return init


def skip_bare_comments(add_chunk: Callable[[Any, bytes], list[str]]) -> Callable[[Any, bytes], list[str]]:
    """Wraps a handler's `add_chunk(self, chunk_bytes)` (its buffer in `self.buffer`): a read that is
    one SSE comment line, its blank line stripped by the caller, arriving when nothing is buffered
    (a message boundary) is dropped; any other read is passed on."""

    def add(self: Any, chunk_bytes: bytes) -> list[str]:
        if not self.buffer and chunk_bytes.startswith(b":") and b"\n" not in chunk_bytes:
            return []
        return add_chunk(self, chunk_bytes)

    return add


if __name__ == "__main__":  # the patches apply to this process alone, never to an importer's
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler
    from vllm.entrypoints.cli.main import main

    aiohttp.TCPConnector.__init__ = fresh_connections(aiohttp.TCPConnector.__init__)  # type: ignore[method-assign]
    StreamedResponseHandler.add_chunk = skip_bare_comments(StreamedResponseHandler.add_chunk)
    sys.argv[0] = "vllm"
    sys.exit(main())
