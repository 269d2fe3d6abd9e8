"""Token buckets: how many requests, and how many prompt tokens, a caller may send per second.

A bucket holds up to ``burst`` units and refills at ``rate`` units per second. A request is let
through when the bucket holds at least its cost, or is full (so a cost larger than the burst is not
refused for ever: it is let through from a full bucket and leaves it in debt, which later requests
wait out). Pure arithmetic on a clock passed in; no I/O, no locks (one event loop).
"""

from __future__ import annotations

import math


class TokenBucket:
    """``take(cost, now)`` answers 0.0 when the cost is let through, else the seconds to wait."""

    __slots__ = ("rate", "burst", "level", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0:
            raise ValueError("a token bucket needs a positive rate")
        self.rate = float(rate)
        self.burst = max(float(burst), 1.0)
        self.level = self.burst
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, cost: float, now: float) -> float:
        self._refill(now)
        need = min(float(cost), self.burst)
        if self.level >= need:
            self.level -= cost
            return 0.0
        return (need - self.level) / self.rate

    def adjust(self, cost: float, now: float) -> None:
        """Charge ``cost`` unconditionally (into debt if need be), or give it back when negative."""
        self._refill(now)
        self.level = min(self.burst, self.level - cost)

    def retune(self, rate: float, burst: float) -> None:
        """New limits (a config reload) without forgetting what was spent."""
        self.rate = float(rate)
        self.burst = max(float(burst), 1.0)
        self.level = min(self.level, self.burst)


def retry_after_s(wait_s: float) -> int:
    """The whole seconds a ``Retry-After`` header should say (at least 1)."""
    return max(1, math.ceil(wait_s))
