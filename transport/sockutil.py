"""Socket teardown that never raises: used wherever a connection is given up on."""

from __future__ import annotations

import socket

__all__ = ["close_quietly", "shutdown_quietly"]


def shutdown_quietly(sock: socket.socket) -> None:
    """Shut both directions (wakes a thread blocked on the socket); ignore a socket already gone."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def close_quietly(sock: socket.socket) -> None:
    """Close; an error here only means the socket is already unusable."""
    try:
        sock.close()
    except OSError:
        pass
