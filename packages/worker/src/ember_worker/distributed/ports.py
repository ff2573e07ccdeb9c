"""Rendezvous ports, importable without torch (the API server picks the data-parallel ones)."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, for a rendezvous (rank 0 binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
