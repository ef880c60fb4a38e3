"""`iterserve serve [MODEL]`: the OpenAI-compatible server.

Flags are the engine's (engine_args.add_engine_args, named as vLLM names them) plus the server's own. A
YAML file given with --config may set the same keys (with dashes or underscores); a flag given on
the command line wins over the file, the file over the built-in default. SIGINT / SIGTERM drain:
new requests get 503, running ones finish for up to --shutdown-timeout seconds, the rest end with an
error (a non-streaming client gets 503, a stream an error event); then the engine thread stops and
the process exits 0.
"""
from __future__ import annotations

import argparse
import gc
import json
import ipaddress
import logging
import os
import socket
from typing import Any

from iterserve.engine_args import add_engine_args, apply_omp_wait, engine_config_from_args, setup_logging
from iterserve.config import parse_size
from iterserve.routing import POLICIES, RouterConfig
from iterserve.server.tool_parsers import PARSERS

log = logging.getLogger("iterserve.server")

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
GRACEFUL_SHUTDOWN_S = 10  # after aborting in-flight requests, how long connections may take to close


class _Unset:
    """A default that the user did not choose, so that a config file may replace it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(self.value)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, "
                    "/v1/responses (streaming with SSE), /v1/embeddings, /v1/models, /tokenize, /detokenize, /health, /metrics (Prometheus), "
                    "/v1/scheduler (live batch, KV cache and per-step records), /v1/scheduler/stream (the same as "
                    "server-sent events) and /dashboard (live charts of it in the browser; one panel per replica with "
                    "--replicas).")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="a .gguf file, a Hugging Face folder, or smollm2-135m (the embedded default)")
    p.add_argument("--model", dest="model_flag", default=None, help="the model, as a flag (same as MODEL)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients must send in 'model' (default: MODEL as given)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $ITERSERVE_API_KEY, else none)")
    g.add_argument("--metrics-without-key", action="store_true", default=False,
                   help="with --api-key: let Prometheus read /metrics without the key")
    g.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names the server answers, '*' for any (default: "
                        "localhost,127.0.0.1,::1 when bound to loopback, which stops DNS-rebinding pages; "
                        "any otherwise)")
    g.add_argument("--max-request-bytes", type=parse_size, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body; larger ones get 413 before they are read (default 4MiB)")
    g.add_argument("--vllm-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="also export metrics under vLLM's vllm:* names, for its dashboards and routers "
                        "(default on)")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM / SIGINT: stop admitting (503, /health 503), let running requests finish "
                        "for up to this many seconds, then abort the rest; a second signal aborts at once "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    g.add_argument("--step-timeout", type=float, default=60.0,
                   help="an engine step running longer than this many seconds turns /health to 503 and fails "
                        "the open requests (a hung kernel or device); raised to what a full prefill step of the "
                        "model may take on a slow host (2 FLOPs per weight per token of --max-num-batched-tokens "
                        "at 30 GFLOP/s: ~950 s for an 8B) where that is longer; 0 = never (default 60)")
    g.add_argument("--max-consecutive-step-failures", type=int, default=3,
                   help="engine steps failing in a row that declare the engine dead: /health 503, every "
                        "request refused (default 3)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="waiting-queue bound: beyond it new requests get HTTP 503 with Retry-After (default: unbounded)")
    g.add_argument("--retry-after", type=int, default=1, help="seconds sent in Retry-After with a 503 (default 1)")
    g.add_argument("--responses-store-size", type=parse_size, default="64MiB",
                   help="the Responses API keeps finished responses (store: true) in memory for GET "
                        "/v1/responses/{id} and previous_response_id, up to this many bytes of their JSON; "
                        "the oldest go first; 0 keeps none (default 64MiB)")
    g.add_argument("--responses-store-ttl", type=float, default=3600.0,
                   help="seconds a stored response is kept (default 3600)")
    t = p.add_argument_group("tool calling (docs/server.md)")
    t.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                   help="accepted for vLLM's command lines: tool_choice \"auto\" is always on here (tools in "
                        "the prompt, the output read by the tool-call parser)")
    t.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="the format tool_choice \"auto\" reads calls in (vLLM's names); default: the one the "
                        "model's chat template writes, else hermes (logged at start-up)")
    t = p.add_argument_group("reasoning models (docs/server.md#reasoning-models)")
    t.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the model's thinking from its answer into reasoning_content / reasoning (chat) "
                        "and a reasoning item (Responses): qwen3, deepseek_r1, granite, smollm3 (= deepseek_r1)")
    t.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="a JSON object of chat-template variables for every chat request, e.g. "
                        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs override its keys")
    t.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="thinking tokens a request may use before the end-of-thinking marker is forced "
                        "(-1: unlimited, the default; a request's thinking_token_budget overrides it); needs "
                        "--reasoning-parser")
    r = p.add_argument_group("scale-out on Ray Serve (docs/scale-out.md; needs pip install 'iterserve[ray]')")
    r.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas on Ray Serve behind one OpenAI-compatible ingress (default: one "
                        "engine in this process, no Ray)")
    r.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (e.g. auto, or ray://head:10001) instead of "
                        "starting a local one")
    r.add_argument("--threads-per-replica", type=int, default=None,
                   help="with --replicas: torch threads and CPUs reserved per replica (default: this machine's "
                        "cores split evenly between replicas, at least 1); on CUDA each replica also takes one GPU")
    r.add_argument("--router", default="prefix", choices=list(POLICIES),
                   help="with --replicas: which replica gets a request. prefix (default): the one expected to "
                        "hold the longest prefix of it in its prefix cache, falling back to the least loaded; "
                        "least-loaded: fewest running + waiting; round-robin")
    r.add_argument("--router-min-match-blocks", type=int, default=RouterConfig.min_match_blocks,
                   help="prefix router: a best match shorter than this many KV blocks routes by load "
                        f"(default {RouterConfig.min_match_blocks})")
    r.add_argument("--router-imbalance-threshold", type=int, default=RouterConfig.imbalance_threshold,
                   help="prefix router: when the busiest replica has more than this many requests above the "
                        f"idlest, route by load (default {RouterConfig.imbalance_threshold})")
    r.add_argument("--stream-interval", type=float, default=None, metavar="S",
                   help="with --replicas: a replica sends a streamed request's new tokens at most every S seconds "
                        "(the first token at once), fewer Ray messages for the same text; 0: every step "
                        "(default 0.05)")
    g.add_argument("--config", default=None,
                   help="YAML file with the same keys as these flags (e.g. max-num-seqs: 32); flags win")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level of the server, access and scheduler logs (default info)")
    for action in p._actions:
        if action.default is not argparse.SUPPRESS and action.dest not in ("help", "config"):
            action.default = _Unset(action.default)
    p.set_defaults(_serve_parser=p)  # func: cli.py's cmd_serve, which also dispatches --replicas
    return p


def _option_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    keys: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in ("help", "config", "model_flag"):  # a file cannot name itself; MODEL is `model`
            continue
        names = [o[2:] for o in action.option_strings if o.startswith("--")] or [action.dest]
        for name in names + [action.dest]:
            keys[name] = keys[name.replace("-", "_")] = action
    return keys


def apply_config(args: argparse.Namespace, parser: argparse.ArgumentParser, config: dict[str, Any]) -> None:
    """Fills every option the command line left at its default from `config`, then unwraps defaults."""
    keys = _option_keys(parser)
    for key, value in config.items():
        action = keys.get(str(key))
        if action is None:
            raise ValueError(f"unknown key {key!r} in --config file")
        if not isinstance(getattr(args, action.dest, None), _Unset):
            continue  # given on the command line: the flag wins
        if isinstance(value, str) and callable(action.type):
            value = action.type(value)
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"--config {key}: {value!r} is not one of {list(action.choices)}")
        setattr(args, action.dest, value)
    for name, value in vars(args).items():
        if isinstance(value, _Unset):
            setattr(args, name, value.value)


def load_config(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must be a mapping of option: value")
    return data


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    apply_config(args, args._serve_parser, load_config(args.config) if args.config else {})
    if args.model_flag:
        if args.model not in (DEFAULT_MODEL, args.model_flag):
            raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
        args.model = args.model_flag
    if args.max_waiting is not None and args.max_waiting < 1:
        raise ValueError("--max-waiting must be >= 1 (leave it out for an unbounded queue)")
    args.api_key = args.api_key or os.environ.get("ITERSERVE_API_KEY") or None
    if isinstance(args.max_request_bytes, str):
        args.max_request_bytes = parse_size(args.max_request_bytes)
    if args.shutdown_timeout < 0 or args.step_timeout < 0:
        raise ValueError("--shutdown-timeout and --step-timeout must be >= 0")
    if args.max_consecutive_step_failures < 1:
        raise ValueError("--max-consecutive-step-failures must be >= 1")
    if isinstance(args.responses_store_size, str):
        args.responses_store_size = parse_size(args.responses_store_size)
    if args.responses_store_ttl <= 0:
        raise ValueError("--responses-store-ttl must be > 0")
    if args.max_request_bytes < 1024:
        raise ValueError("--max-request-bytes must be at least 1KiB")
    resolve_reasoning_args(args)
    if getattr(args, "enable_lora", False) and args.replicas is not None:
        raise ValueError("--enable-lora is not available with --replicas yet: the ingress cannot load, unload or "
                         "route adapters")
    if isinstance(args.allowed_hosts, str):
        args.allowed_hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    if args.allowed_hosts is None:
        args.allowed_hosts = default_allowed_hosts(args.host)
    return args


def resolve_reasoning_args(args: argparse.Namespace) -> None:
    """--reasoning-parser must name a parser, --default-chat-template-kwargs be a JSON object (or a
    YAML mapping in --config), --reasoning-budget -1 or more and only with a parser."""
    from iterserve.server.reasoning import get_parser
    from iterserve.server.reasoning.request import check_default_template_kwargs

    if args.reasoning_parser is not None:
        get_parser(args.reasoning_parser)  # ValueError listing the names
    kwargs = args.default_chat_template_kwargs
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except ValueError as e:
            raise ValueError(f"--default-chat-template-kwargs is not valid JSON: {e}") from None
    args.default_chat_template_kwargs = check_default_template_kwargs(kwargs) if kwargs is not None else None
    if args.reasoning_budget < -1:
        raise ValueError("--reasoning-budget must be -1 (unlimited) or a number of tokens >= 0")
    if args.reasoning_budget >= 0 and args.reasoning_parser is None:
        raise ValueError("--reasoning-budget needs --reasoning-parser (it forces that parser's end-of-thinking marker)")


def build_server(args: argparse.Namespace, loaded=None):
    """(AsyncEngine, FastAPI app) as `serve` wires them from resolved arguments. `loaded` = (model,
    ModelConfig, tokenizer) shares an already loaded model (the in-process API tests). The imports
    are here, not at the top, to keep `iterserve --help` fast."""
    from iterserve.engine import LLMEngine
    from iterserve.server.api import build_app
    from iterserve.server.async_engine import AsyncEngine

    engine = AsyncEngine(LLMEngine(engine_config_from_args(args, model=args.model), loaded=loaded),
                         step_timeout=args.step_timeout or None,
                         max_consecutive_failures=args.max_consecutive_step_failures)
    return engine, build_app(engine, server_settings(args))


def server_settings(args: argparse.Namespace):
    from iterserve.server.serving import ServerSettings

    return ServerSettings(served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                          retry_after_s=args.retry_after, max_request_bytes=args.max_request_bytes,
                          metrics_without_key=args.metrics_without_key, allowed_hosts=args.allowed_hosts,
                          vllm_metrics=args.vllm_metrics, responses_store_bytes=args.responses_store_size,
                          responses_store_ttl_s=args.responses_store_ttl, tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          default_chat_template_kwargs=args.default_chat_template_kwargs,
                          reasoning_budget=args.reasoning_budget)


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """What `serve` does first, with or without --replicas (cli.py's cmd_serve chooses which runs next):
    the --config file, OpenMP's wait policy, the port (fail in a second, not after loading the model),
    logging."""
    args = resolve_args(args)
    apply_omp_wait(args.omp_wait)  # says so if a --config file asked for spin after torch loaded
    check_bind(args.host, args.port)
    setup_logging(args.log_level == "debug")
    logging.getLogger("iterserve").setLevel(args.log_level.upper())
    return args


def serve_one_process(args: argparse.Namespace) -> int:
    """The single-process server, from prepared arguments; returns when it has drained."""
    import uvicorn

    engine, app = build_server(args)
    # As vLLM does: move everything that exists now (model, tokenizer, libraries) out of the garbage
    # collector's reach. Otherwise a full collection walks millions of startup objects while holding
    # the GIL: a pause of hundreds of ms in the middle of serving.
    gc.collect()
    gc.freeze()
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    make_server(uv_config, engine, args.shutdown_timeout).run()
    return 0


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """Loopback names when bound to loopback (a page on another site cannot reach the server through
    DNS rebinding); any Host (None) otherwise."""
    if bind_host == "localhost":
        return list(LOOPBACK_NAMES)
    try:
        return list(LOOPBACK_NAMES) if ipaddress.ip_address(bind_host.strip("[]")).is_loopback else None
    except ValueError:  # a host name: its own name is what clients send
        return None


def check_bind(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def make_server(config, engine, shutdown_timeout: float):
    """A uvicorn.Server that drains on the first signal and exits 0 afterwards (rather than
    re-raising the signal). Draining keeps the socket open, so that clients get a 503 with
    Retry-After (and /health a 503) instead of a refused connection while the running requests
    finish; once they have (or shutdown_timeout passed and the rest were aborted) uvicorn shuts
    down as usual. A second signal skips the wait. uvicorn is imported here, not at module
    import, to keep `iterserve --help` fast."""
    import uvicorn

    class Server(uvicorn.Server):
        drain_started = False

        def handle_exit(self, sig, frame) -> None:
            getattr(self, "_captured_signals", []).clear()
            if not self.drain_started and not self.should_exit:
                self.drain_started = True
                log.info("signal %s: draining for up to %g s", getattr(sig, "name", sig), shutdown_timeout)
                engine.begin_drain(shutdown_timeout, on_done=self.drained)
                return
            super().handle_exit(sig, frame)  # a second signal: abort now and exit
            engine.abort_in_flight()

        def drained(self) -> None:
            self.should_exit = True

    return Server(config)
