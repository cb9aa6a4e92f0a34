"""Whether a listen address can be bound, asked before binding, to answer a busy port in one line.

A server that fails to bind deep in its start-up (gRPC, prometheus_client)
ends in a long traceback that hides the only fact the operator needs: which
address is taken and which setting moves it. So ``serve`` and the demo try
each address first; the real bind a moment later can still lose a race, and
then the caller reports that one too, less precisely.
"""

from __future__ import annotations

import errno
import socket

from extproc.adapters.config import split_address


def bind_problem(address: str) -> str | None:
    """None if ``HOST:PORT`` can be listened on now, else what is wrong ("is in use", "cannot be bound: ...")."""
    host, port = split_address(address)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"cannot be resolved: {exc.strerror}"
    with socket.socket(family, kind, proto) as probe:
        # As the servers bind: a port whose last connections linger in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            return "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc.strerror}"
    return None
