"""The listening socket of `laplace serve`, bound before anything heavy is imported or loaded
(as vLLM binds its port before it starts the engine): a busy port fails at once, not after a
warmup of minutes, and connections made while the model loads wait in the backlog."""

from __future__ import annotations

import socket


class PortInUse(OSError):
    pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, before the model loads (as vLLM binds before it starts its
    engine): connections queue in its backlog meanwhile, and a busy port is PortInUse at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT may be reused, a listener not
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUse(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
