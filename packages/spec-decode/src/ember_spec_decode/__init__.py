"""Speculative decoding proposers and rejection sampler for Ember."""

__version__ = "0.1.0"
