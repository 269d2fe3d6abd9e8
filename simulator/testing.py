"""Small helpers for tests, demos and benchmarks that start simulated pods."""

from __future__ import annotations

import random
import socket


def consecutive_free_ports(n: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port P such that P..P+n-1 were all free a moment ago (for ``--count`` and event ports)."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                socks.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")
