"""Faults on demand: set by flags at start, per request with the ``x-sim-fault`` header, or at run
time with ``POST /sim/faults`` (JSON). Pod-wide faults are fields of ``Faults``; a request's header
overrides the per-request ones for that request only.

Header syntax: comma-separated ``key=value``: ``status=503``, ``delay=0.25`` (seconds),
``drop=3`` (drop the connection after 3 response chunks; 0 = before any byte), ``eos=1`` (the first
output token is EOS: the request stops there unless it sets ``ignore_eos``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class FaultError(ValueError):
    pass


@dataclass
class RequestFaults:
    status: int | None = None
    delay_s: float = 0.0
    drop_after_chunks: int | None = None
    eos_after: int | None = None


@dataclass
class Faults:
    status: int | None = None
    delay_s: float = 0.0
    drop_after_chunks: int | None = None
    events_stop: bool = False
    slowdown: float = 1.0
    eos_after: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def update(self, data: Any) -> None:
        """Apply a ``POST /sim/faults`` body; validates everything before changing anything."""
        if not isinstance(data, dict):
            raise FaultError("body must be a JSON object")
        allowed = set(self.as_dict()) | {"events_restart"}
        unknown = set(data) - allowed
        if unknown:
            raise FaultError(f"unknown fault fields: {sorted(unknown)}; known: {sorted(allowed)}")
        new = self.as_dict()
        for key, value in data.items():
            if key == "events_restart":
                continue
            new[key] = _check(key, value)
        for key, value in new.items():
            setattr(self, key, value)

    def for_request(self, header: str | None) -> RequestFaults:
        rf = RequestFaults(self.status, self.delay_s, self.drop_after_chunks, self.eos_after)
        if not header:
            return rf
        for item in header.split(","):
            key, _, value = item.strip().partition("=")
            key = key.strip().lower()
            if not key:
                continue
            try:
                if key == "status":
                    rf.status = _check("status", int(value))
                elif key == "delay":
                    rf.delay_s = _check("delay_s", float(value))
                elif key == "drop":
                    rf.drop_after_chunks = _check("drop_after_chunks", int(value))
                elif key == "eos":
                    rf.eos_after = _check("eos_after", int(value))
                else:
                    raise FaultError(f"unknown x-sim-fault key {key!r} (status, delay, drop, eos)")
            except ValueError as exc:
                raise FaultError(f"bad x-sim-fault item {item.strip()!r}: {exc}") from exc
        return rf


def _check(key: str, value: Any) -> Any:
    if key == "status":
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 400 <= value <= 599:
            raise FaultError("status must be an integer 400..599 or null")
        return value
    if key == "delay_s":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 3600:
            raise FaultError("delay_s must be a number of seconds in [0, 3600]")
        return float(value)
    if key == "drop_after_chunks":
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise FaultError("drop_after_chunks must be a non-negative integer or null")
        return value
    if key == "eos_after":
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FaultError("eos_after must be a positive integer or null")
        return value
    if key == "events_stop":
        if not isinstance(value, bool):
            raise FaultError("events_stop must be true or false")
        return value
    if key == "slowdown":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1000:
            raise FaultError("slowdown must be a number in (0, 1000]")
        return float(value)
    raise FaultError(f"unknown fault {key!r}")
