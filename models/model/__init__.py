"""The model: ``config`` (LlamaConfig, presets), ``families`` (the architectures it runs and how
checkpoints name them), ``rope`` (rotary embeddings), ``llama`` (the NNX decoder, built from
arrays or drawn at random), ``graph`` (a model split once for the jitted programs that take it)."""
