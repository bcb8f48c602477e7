"""Generation: ``cache`` (shared segments stored once + per-sequence K/V), ``prompt_tree`` and
``sharing`` (where sharing occurs, detected by a radix tree), ``loop`` (prefill + one jitted
decode loop: generate, prefill, decode), ``sampling``, ``settings`` (GenerationSettings, the
value that says how tokens are generated), ``programs`` and ``compile_cache`` (traced and
compiled programs kept across runs)."""
