"""Placement: pure functions over frozen snapshots that decide where a request runs."""
