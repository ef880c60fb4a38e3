"""Measuring a running server over HTTP: workloads, the load client, its records and reports, and the
`bench`, `compare`, `probe` and `tune` commands.

Imports go one way: the capacity simulator (`iterserve.sim`) consumes these workloads, request
records and reports, so nothing here imports `iterserve.sim` (`tune --simulate` lives in
sim/tune_simulated.py; cli.py dispatches to it). Comparisons with other engines and one-off A/B
scripts are not commands and live in the repository's benchmarks/ folder, not here.
"""
