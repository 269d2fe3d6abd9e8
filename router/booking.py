"""The router's ledger of prefill work it has sent to each pod and not yet seen start producing.

Work is booked the moment a pod is picked (so a burst of requests sees each other at once, not a
scrape later) and released when the first token comes back. Each pod is modelled as a FIFO prefill
server: the work still queued is what was booked less what the pod has had time to do since it
last delivered a first token (or since it went busy).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class _PodLedger:
    bookings: dict[int, float] = field(default_factory=dict)
    tokens: float = 0.0
    service_start: float = 0.0


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._pods: dict[str, _PodLedger] = {}
        self._ids = itertools.count(1)

    def _pod(self, pod_id: str) -> _PodLedger:
        led = self._pods.get(pod_id)
        if led is None:
            led = self._pods[pod_id] = _PodLedger()
        return led

    def queued_tokens(self, pod_id: str, rate: float) -> float:
        """Booked prefill work not yet done, in tokens, at ``rate`` tokens/s."""
        led = self._pods.get(pod_id)
        if led is None or not led.bookings:
            return 0.0
        done = (self._clock() - led.service_start) * rate
        # the head request cannot be more than finished; the others have not started
        head = next(iter(led.bookings.values()))
        return max(led.tokens - min(done, head), 0.0)

    def inflight(self, pod_id: str) -> int:
        led = self._pods.get(pod_id)
        return len(led.bookings) if led else 0

    def book(self, pod_id: str, tokens: float) -> int:
        led = self._pod(pod_id)
        if not led.bookings:
            led.service_start = self._clock()
        ticket = next(self._ids)
        led.bookings[ticket] = float(tokens)
        led.tokens += float(tokens)
        return ticket

    def release(self, pod_id: str, ticket: int) -> bool:
        """Release a booking (first token seen, or the request ended). Idempotent."""
        led = self._pods.get(pod_id)
        if led is None:
            return False
        tokens = led.bookings.pop(ticket, None)
        if tokens is None:
            return False
        led.tokens = max(led.tokens - tokens, 0.0) if led.bookings else 0.0
        led.service_start = self._clock()
        return True

    def forget(self, pod_id: str) -> None:
        self._pods.pop(pod_id, None)

    def totals(self) -> dict[str, tuple[int, float]]:
        return {pid: (len(led.bookings), led.tokens) for pid, led in self._pods.items()}
