"""The model: ``config`` (LlamaConfig, presets), ``rope`` (rotary embeddings), ``llama`` (the
NNX decoder, built from arrays or drawn at random)."""
