"""Offline LLM API, OpenAI-compatible HTTP server, metrics and CLI of Ember."""

__version__ = "0.1.0"
