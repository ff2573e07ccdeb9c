"""Ember: an LLM inference and serving engine. This meta-package re-exports the public API.

The names and the modules behind them are ``ember_server``'s (its ``__all__``): one list, kept
there.
"""

import ember_server
from ember_server import *  # noqa: F403

__version__ = "0.1.0"

__all__ = list(ember_server.__all__)
