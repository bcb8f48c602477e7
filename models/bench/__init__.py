"""Benchmarks: ``python -m models.bench attention`` (see attention.py)."""
