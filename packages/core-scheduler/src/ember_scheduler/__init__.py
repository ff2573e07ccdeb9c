"""Continuous-batching scheduler, requests and engine core of Ember."""

__version__ = "0.1.0"
