"""`vllm bench serve` with one new HTTP connection per request; run by the vLLM install's Python.

Why: the client keeps its connections alive and reuses them when a request ends and the next one
of the same slot starts. llama.cpp's server (`llama-server`) answers a streamed completion with
`Keep-Alive: timeout=5, max=100` and then closes the connection, so the reused connection fails
at refill ("Cannot write to closing transport"; under load also streams read as empty: "Never
received a valid chunk") although the server's own log shows every request served. Two streamed
requests in a row on one aiohttp connection reproduce it on an idle host. A fresh connection per
request costs about a millisecond on loopback, against seconds a request, and every system in a
comparison is measured the same way.

    $PEERS/vvenv/bin/python benchmarks/peers/vllm_bench_fresh.py bench serve ...   # vllm's arguments
"""
import sys

import aiohttp

_connector_init = aiohttp.TCPConnector.__init__


def _fresh_connections(self: aiohttp.TCPConnector, *args: object, **kwargs: object) -> None:
    kwargs.pop("keepalive_timeout", None)  # aiohttp refuses a keep-alive timeout beside force_close
    kwargs["force_close"] = True
    _connector_init(self, *args, **kwargs)


aiohttp.TCPConnector.__init__ = _fresh_connections  # type: ignore[method-assign]

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
