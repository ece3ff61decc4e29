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
from pathlib import Path
from typing import Iterator


@contextmanager
def held_port(host: str = "0.0.0.0") -> Iterator[int]:
    """A free port, held (bound on `host`, not listening) until the block ends; bind it with SO_REUSEADDR."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        yield sock.getsockname()[1]


@contextmanager
def refusing_url(path: str = "") -> Iterator[str]:
    """`http://127.0.0.1:PORT` + `path` where every connection is refused while the block runs: a `held_port`, bound
    and never listened on (a dead backend, collector or generator that no other process can come to life on)."""
    with held_port("127.0.0.1") as port:
        yield f"http://127.0.0.1:{port}{path}"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (IPv4 and IPv6), read from /proc (Linux): for a server that binds
    port 0 when told but does not say which port it got."""
    mine = _socket_inodes(pid)
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            # local address (hex ip:port), state (0A: LISTEN), inode
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in mine:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
