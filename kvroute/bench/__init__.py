"""Measurement helpers used by ``scripts/measure_disagg.py`` (not part of the serving path)."""
