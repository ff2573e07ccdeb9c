"""Ember: an LLM inference and serving engine. This meta-package re-exports the public API."""

__version__ = "0.1.0"
