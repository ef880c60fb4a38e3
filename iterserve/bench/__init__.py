"""Benchmark tooling that drives a server over HTTP: workloads, load client, the `bench` CLI."""
