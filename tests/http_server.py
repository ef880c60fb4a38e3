"""`iterserve serve` on a real loopback socket inside the test process: the app as build_server wires
it from a command line, under uvicorn in a thread, over a model the test has loaded. Unlike
app_server.AppServer (ASGI in memory) a client talks real HTTP to it; unlike a ServerProcess, the
test can reach into the process (a scripted sampling hook, the engine)."""
from __future__ import annotations

import socket
import threading
import time


class HttpServer:
    """`iterserve serve` as build_server wires it, under uvicorn on a free loopback port, in a thread."""

    def __init__(self, argv: list[str], loaded) -> None:
        import uvicorn

        from iterserve.cli import build_parser
        from iterserve.server.cli_serve import build_server, resolve_args

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = resolve_args(build_parser().parse_args(["serve", *argv, "--port", str(port)]))
        self.engine, app = build_server(args, loaded)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"  # the server's root (Anthropic's clients take this)
        self.base_url = self.url + "/v1"  # OpenAI's clients take this

    def __enter__(self) -> HttpServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
