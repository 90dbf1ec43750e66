"""Listening sockets on the address their peers dial, never on every interface where that
address can be bound here (docs/security.md lists each listener).

Example::

    sock, host = listen("10.0.0.5")   # bound to 10.0.0.5 on a free port; peers dial 10.0.0.5
    data = receive_exactly(connection, 32)  # exactly 32 bytes, or ConnectionError
"""
from __future__ import annotations

import logging
import socket
from typing import Tuple

log = logging.getLogger("sparktrain")
_WARNED: set = set()


def listen(host: str, backlog: int = 64) -> Tuple[socket.socket, str]:
    """A TCP socket listening on ``host`` (a name or an address of this machine, as Spark
    knows this executor) on a free port, and the host its peers dial. Where ``host`` is not
    an address of this machine (a container behind NAT, whose advertised address lies
    outside it), it listens on every interface and says so once: the listener's own
    authentication is then all that keeps strangers out."""
    try:
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, 0), family=family, backlog=backlog), host
    except OSError as exc:  # not resolvable, or not an address of this machine
        if host not in _WARNED:
            _WARNED.add(host)
            log.warning("cannot listen on %s (%s): listening on every interface of this "
                        "machine instead", host, exc)
        return socket.create_server(("", 0), backlog=backlog), host


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``, or ``ConnectionError`` if it closes first."""
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError("the connection closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
