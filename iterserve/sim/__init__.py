"""The capacity simulator: step profiles (`profile`), `simulate`, `plan`, and `tune --simulate`.

It drives the engine's own scheduler and block pool on a simulated clock and speaks the measuring
tools' language: workloads, request records, streaming summaries and timelines from
`iterserve.bench`, so that `compare` reads simulated and measured runs alike. Imports go one way,
sim -> bench, never back. Replicas are routed by the deployment's own policy (`iterserve.routing`).
"""
