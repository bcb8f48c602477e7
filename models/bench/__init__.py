"""Benchmarks (nothing in the library imports them; the CLI's command table does):
``hydragen bench decode | tree | sampler | compare | sharded | train`` and
``python -m models.bench attention | backward``. ``common`` and ``timing`` hold what they share."""
