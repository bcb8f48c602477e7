"""Benchmarks (nothing in the library imports them; the CLI's command table does):
``hydragen bench decode | tree | sampler | compare | sharded | train | serve`` and
``python -m models.bench attention | backward | serve``. ``common`` and ``timing`` hold what they share."""
