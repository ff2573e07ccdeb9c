"""The event loop the API server runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop's event loop where it is installed (a dependency of ember-server
    except on Windows; vLLM's server does the same), else on asyncio's: uvloop's accept, socket
    and timer paths are compiled, where asyncio's loop runs them in Python."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
