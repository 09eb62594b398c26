"""The one place that knows Hugging Face model internals: per-architecture adapters."""
