"""Llama-family decoding with shared-prefix (Hydragen) attention.

Public API: see docs/models.md.
"""
