"""A port for the rare server that must be told its port before it starts and cannot say which one it got: a
manifest's fixed port that other settings name (an agent's base URL, a probe, an upstream URL), or an external
program (Prometheus).

`held_port()` binds a free port here, with SO_REUSEADDR and without listening, and holds it until the block ends.
Meanwhile a connection to it is refused (nothing listens), no other socket bound to port 0 can get it (the kernel
skips a port that a socket holds), and a server told to bind it with SO_REUSEADDR — uvicorn and `toolquake serve`,
the fake upstream, Python's HTTP servers, Go's (Prometheus) — binds it and listens: no window in which another
process can take it, unlike a port picked (bound and closed) and bound later by a child."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def held_port(host: str = "0.0.0.0") -> Iterator[int]:
    """A free port, held (bound on `host`, not listening) until the block ends; bind it with SO_REUSEADDR."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        yield sock.getsockname()[1]
