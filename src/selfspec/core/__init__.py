"""Primitives with no knowledge of models: skip sets, the KV cache, linear kernels, sampling."""
