"""What the router has sent to pods and not yet seen start: the ledger and the bookings that hold it.

The ledger keeps two resources per pod:

- **prefill work**: booked the moment a pod is picked (so a burst of requests sees each other at
  once, not a scrape later) and released when the first token comes back. Each pod is modelled as
  a FIFO prefill server: the work still queued is what was booked less what the pod has had time
  to do since it last delivered a first token (or since it went busy).
- **KV room** (decode pods under prefill/decode disaggregation): the prompt plus expected output
  the router sent there, which the pod's own KV usage may not show yet.

A ``Booking`` is one request's hold on both; ``Booking.release`` gives them back exactly once,
whichever way the request ends.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _PodLedger:
    bookings: dict[int, float] = field(default_factory=dict)
    tokens: float = 0.0
    service_start: float = 0.0
    kv: dict[int, float] = field(default_factory=dict)


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

    # ---- prefill work --------------------------------------------------------------------
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

    # ---- KV room on decode pods ----------------------------------------------------------
    def book_kv(self, pod_id: str, tokens: float) -> int:
        ticket = next(self._ids)
        self._pod(pod_id).kv[ticket] = float(tokens)
        return ticket

    def release_kv(self, pod_id: str, ticket: int) -> bool:
        led = self._pods.get(pod_id)
        return led is not None and led.kv.pop(ticket, None) is not None

    def kv_booked(self, pod_id: str) -> tuple[int, float]:
        """(requests, tokens) of KV booked on ``pod_id`` and not yet released."""
        led = self._pods.get(pod_id)
        return (len(led.kv), sum(led.kv.values())) if led and led.kv else (0, 0.0)

    # ---- fleet ---------------------------------------------------------------------------
    def forget(self, pod_id: str) -> None:
        self._pods.pop(pod_id, None)

    def totals(self) -> dict[str, tuple[int, float]]:
        return {pid: (len(led.bookings), led.tokens) for pid, led in self._pods.items()}

    def empty(self) -> bool:
        """Nothing booked anywhere (every request has ended)."""
        return not any(led.bookings or led.kv for led in self._pods.values())


@dataclass
class Booking:
    """One request's hold on the ledger, made by ``Router.book`` and released once by ``release``.

    ``pod_id`` is where the request is sent; ``prefill_pod`` the pod that computes its prompt (the
    same pod, or under P/D a prefill pod). ``work_tokens`` is the prefill work ahead of the first
    token on ``prefill_pod`` (its queue plus the request's own uncached tokens), which the
    calibrator divides by the observed time."""

    pod_id: str
    prefill_pod: str
    prefill_ticket: int
    work_tokens: float
    predicted_ttft_s: float
    cached_tokens: int
    mode: str = "aggregated"   # "aggregated", or under P/D "local" / "remote"
    kv_ticket: int | None = None
    sent_at: float = field(default_factory=time.monotonic)
    new_blocks: int = 0  # full prompt blocks the pod did not hold: its engine must announce them
    released: bool = False

    @property
    def remote(self) -> bool:
        return self.mode == "remote"

    def release(self, ledger: Ledger) -> bool:
        """Give back the prefill work and the KV room; True the first time only."""
        if self.released:
            return False
        self.released = True
        ledger.release(self.prefill_pod, self.prefill_ticket)
        if self.kv_ticket is not None:
            ledger.release_kv(self.pod_id, self.kv_ticket)
        return True
