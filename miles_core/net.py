"""Ports and addresses of the servers a run starts (SGLang, torch elastic's rendezvous, gloo, test peers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from urllib.parse import urlsplit

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # above the ports services and Ray's workers (10002-19999) listen on by default
_pick = random.SystemRandom()  # never the seeded global generator: two seeded processes would pick the same ports


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server that binds it later (SGLang only after its engine has started, ~30 s).

    Chosen at random below the kernel's ephemeral range where there is one: ports there are never given to outgoing
    connections, which otherwise may take the port in between. The server's own bind still has to cope with another
    process binding it first (`SGLangServer.launch` starts again on another port)."""
    low = int(_RANGE.read_text().split()[0]) if _RANGE.exists() else 0
    for _ in range(100 if low - _LOWEST >= 1000 else 0):
        port = _pick.randrange(_LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_toward(url: str) -> str:
    """This machine's address on the route to `url`'s host: where a server there connects back to (loopback for a
    server on this machine, the pod's address for one in another pod). A UDP connect picks the route and sends nothing."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(parts.hostname or "localhost"), parts.port or 80))
        return s.getsockname()[0]
