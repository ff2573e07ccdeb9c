"""Paged KV block pool, prefix cache and KV cache manager for LLM inference engines."""

__version__ = "0.1.0"
