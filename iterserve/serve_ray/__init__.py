"""Scale-out on Ray Serve: engine replicas behind one OpenAI-compatible ingress and a prefix-aware router.

`iterserve serve --replicas N` builds one Serve application of two deployments: `EngineReplica`
(replica.py: one LLMEngine and its AsyncEngine loop per replica) and `Ingress` (ingress.py: the very
API of the single-process server, server/api.py's build_api, over a RemoteEngine that sends each
admitted request to a replica through a streaming deployment handle). Which replica gets a request is
decided in the ingress by `IterserveRequestRouter` (router.py, Ray Serve's RequestRouter API) from
the policy in iterserve/routing.py (shared with the simulator). launch.py starts it for
`serve --replicas`, which cli.py dispatches here: serve_ray builds on server (its API, settings and
flags), server never imports serve_ray. Ray is an optional dependency (`pip install
'iterserve[ray]'`); nothing outside this package imports it.
"""
