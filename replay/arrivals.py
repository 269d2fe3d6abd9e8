"""Arrival processes: when each request is sent, as offsets in seconds from the start of the run.

All processes are open-loop (a send never waits for an earlier answer) and seeded, so the same
``seed`` gives the same schedule. The first request goes at offset 0.

* ``trace``: the workload's own timestamps, shifted to start at 0 and multiplied by ``time_scale``
  (0.1 replays ten times faster).
* ``poisson``: exponential gaps with mean ``1/rate``.
* ``gamma``: gamma gaps with shape ``burstiness`` and mean ``1/rate`` (coefficient of variation
  ``1/sqrt(burstiness)``; 1 is Poisson, below 1 is burstier), like ``vllm bench serve``.
* ``constant``: gaps of exactly ``1/rate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KINDS = ("trace", "poisson", "gamma", "constant")


def _check_rate(rate: float | None) -> float:
    if rate is None or not rate > 0 or rate == float("inf"):
        raise ValueError(f"a positive, finite --rate is needed for this arrival process, got {rate}")
    return float(rate)


def _from_gaps(gaps: np.ndarray) -> list[float]:
    if len(gaps) == 0:
        return []
    out = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return out.tolist()


def constant(n: int, rate: float) -> list[float]:
    rate = _check_rate(rate)
    return [i / rate for i in range(n)]


def poisson(n: int, rate: float, seed: int = 0) -> list[float]:
    rate = _check_rate(rate)
    rng = np.random.default_rng([seed, 101])
    return _from_gaps(rng.exponential(1.0 / rate, size=n))


def gamma(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    rate = _check_rate(rate)
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng([seed, 102])
    return _from_gaps(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))


def from_trace(timestamps: Sequence[float | None], time_scale: float = 1.0) -> list[float]:
    if not time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    times = [t for t in timestamps if t is not None]
    if len(times) < len(timestamps):
        raise ValueError("this workload has no timestamps; choose --arrival poisson, gamma or constant")
    if not times:
        return []
    t0 = min(times)
    return [(float(t) - t0) * time_scale for t in times]


def schedule(kind: str, n: int, *, rate: float | None = None, burstiness: float = 1.0, seed: int = 0,
             timestamps: Sequence[float | None] | None = None, time_scale: float = 1.0) -> list[float]:
    """Send offsets (s) for ``n`` requests under arrival process ``kind``."""
    if kind == "trace":
        return from_trace(list(timestamps or [])[:n], time_scale)
    if kind == "poisson":
        return poisson(n, rate, seed)  # type: ignore[arg-type]
    if kind == "gamma":
        return gamma(n, rate, burstiness, seed)  # type: ignore[arg-type]
    if kind == "constant":
        return constant(n, rate)  # type: ignore[arg-type]
    raise ValueError(f"unknown arrival process {kind!r}; choose one of {', '.join(KINDS)}")


def cut(offsets: Sequence[float], *, duration: float | None = None, max_requests: int | None = None) -> int:
    """How many leading requests fit ``--duration`` (sent before it) and ``--max-requests``."""
    n = len(offsets)
    if max_requests is not None:
        n = min(n, max(0, int(max_requests)))
    if duration is not None:
        n = min(n, int(np.searchsorted(np.asarray(offsets[:n]), duration, side="left")))
    return n
