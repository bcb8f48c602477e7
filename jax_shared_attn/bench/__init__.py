"""Benchmarks: ``python -m jax_shared_attn.bench attention`` (see attention.py)."""
