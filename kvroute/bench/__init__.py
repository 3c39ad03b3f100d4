"""Helpers for benchmarks and end-to-end tests: workloads, the serve subprocess, raw
transport baselines. Not part of the serving path."""
