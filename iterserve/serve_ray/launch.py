"""`iterserve serve --replicas N`: the same API on Ray Serve, from `serve`'s prepared arguments.

Imports no Ray at module level: the local cluster's environment must be set before Ray is imported,
and without Ray installed `--replicas` must say how to install it rather than fail on an import.
cli.py's cmd_serve calls serve_replicas; serve_ray builds on server (its API, settings and flags),
never the other way round.
"""
from __future__ import annotations

import argparse
import os

from iterserve.engine_args import engine_config_from_args
from iterserve.routing import RouterConfig
from iterserve.server.cli_serve import server_settings

# Environment of a local cluster that `serve --replicas` starts, set (unless already set) before Ray
# is imported, since Serve reads it at import in every process, this one included: Serve's documented
# throughput switch (user code and the request router on each replica's own event loop instead of
# threads of their own, gRPC between proxy and replicas, request logs buffered and not copied to
# stderr). The hops between event loops were most of the ingress's CPU per request.
LOCAL_CLUSTER_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def serve_replicas(args: argparse.Namespace) -> int:
    """--replicas N: the same API on Ray Serve (iterserve/serve_ray). Ray is an optional dependency,
    imported only here so that the single-process server never needs it."""
    if args.ray_address is None:
        for key, value in LOCAL_CLUSTER_ENV.items():
            os.environ.setdefault(key, value)
    try:
        from iterserve.serve_ray.app import ScaleOutConfig, run_until_signal
    except ImportError as e:
        if (e.name or "").split(".")[0] != "ray":
            raise
        raise SystemExit("--replicas needs Ray Serve, which is not installed: pip install 'iterserve[ray]' "
                         "(or pip install 'ray[serve]')") from None
    config = engine_config_from_args(args, model=args.model)
    router = RouterConfig(policy=args.router, block_size=config.block_size,
                          min_match_blocks=args.router_min_match_blocks,
                          imbalance_threshold=args.router_imbalance_threshold)
    interval = {} if args.stream_interval is None else {"stream_interval_s": args.stream_interval}
    scale = ScaleOutConfig(replicas=args.replicas, threads_per_replica=args.threads_per_replica, router=router,
                           **interval)
    return run_until_signal(config, server_settings(args), scale, args.host, args.port, args.ray_address)
