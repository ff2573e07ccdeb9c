"""The server's listening socket, bound before anything else starts."""

from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``: bound before the model loads, so that a port in use
    (or a bad host) fails at once, not after the minutes a model can take."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        listener = socket.create_server((host, port), family=family[0][0], backlog=2048)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OSError(f"cannot listen on {host}:{port}: {reason} (pass another --port)") from None
    # asyncio turns Nagle's algorithm off only on sockets whose ``proto`` is IPPROTO_TCP, and
    # ``create_server`` leaves it 0; without this, every response on a kept-alive connection
    # waited 40 ms for the client's delayed ACK. From the descriptor alone, ``proto`` is read back.
    return socket.socket(fileno=listener.detach())
