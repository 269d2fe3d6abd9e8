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

Other router processes (the workers of one ``kvroute serve``, router replicas) book the same pods.
Their bookings reach this ledger over the booking bus (``router/bookbus.py``) as **foreign**
bookings, keyed by (origin, ticket): ``apply_foreign`` adds or releases one, ``replace_origin``
swaps in an origin's full snapshot, ``forget_origin`` drops an origin that went silent. They sit in
the same per-pod FIFO as local bookings, so ``inflight``, ``queued_tokens`` and ``kv_booked``
count them; local bookings keep their API and semantics, and ``on_change`` (if set) is told of
each local book and release so the bus can publish it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PREFILL, KV = "prefill", "kv"
# a local booking's key is its ticket; a foreign one's is (origin, ticket)
Key = int | tuple[str, int]
# on_change(event, pod, ticket, tokens, resource): event "book" or "release"; resource PREFILL or KV
ChangeHook = Callable[[str, str, int, float, str], None]


@dataclass
class _PodLedger:
    bookings: dict[Key, float] = field(default_factory=dict)
    tokens: float = 0.0
    service_start: float = 0.0
    kv: dict[Key, float] = field(default_factory=dict)


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.monotonic, on_change: ChangeHook | None = None):
        self._clock = clock
        self._pods: dict[str, _PodLedger] = {}
        self._ids = itertools.count(1)
        self.on_change = on_change
        # per origin: (pod, resource, ticket) -> tokens of the foreign bookings held for it
        self._foreign: dict[str, dict[tuple[str, str, int], float]] = {}

    def _pod(self, pod_id: str) -> _PodLedger:
        led = self._pods.get(pod_id)
        if led is None:
            led = self._pods[pod_id] = _PodLedger()
        return led

    # ---- prefill work --------------------------------------------------------------------
    def queued_tokens(self, pod_id: str, rate: float) -> float:
        """Booked prefill work not yet done, in tokens, at ``rate`` tokens/s."""
        return self.load(pod_id, rate)[1]

    def load(self, pod_id: str, rate: float) -> tuple[int, float]:
        """(``inflight``, ``queued_tokens``) of ``pod_id`` in one look (a decision reads both per pod)."""
        led = self._pods.get(pod_id)
        if led is None or not led.bookings:
            return 0, 0.0
        done = (self._clock() - led.service_start) * rate
        # the head request cannot be more than finished; the others have not started
        head = next(iter(led.bookings.values()))
        return len(led.bookings), max(led.tokens - min(done, head), 0.0)

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
        if self.on_change is not None:
            self.on_change("book", pod_id, ticket, float(tokens), PREFILL)
        return ticket

    def _add_prefill(self, pod_id: str, key: Key, tokens: float) -> None:
        led = self._pod(pod_id)
        if not led.bookings:
            led.service_start = self._clock()
        led.bookings[key] = tokens
        led.tokens += tokens

    def _pop_prefill(self, pod_id: str, key: Key) -> float | None:
        led = self._pods.get(pod_id)
        if led is None:
            return None
        tokens = led.bookings.pop(key, None)
        if tokens is None:
            return None
        led.tokens = max(led.tokens - tokens, 0.0) if led.bookings else 0.0
        led.service_start = self._clock()
        return tokens

    def release(self, pod_id: str, ticket: int) -> bool:
        """Release a booking (first token seen, or the request ended). Idempotent."""
        tokens = self._pop_prefill(pod_id, ticket)
        if tokens is None:
            return False
        if self.on_change is not None:
            self.on_change("release", pod_id, ticket, tokens, PREFILL)
        return True

    # ---- KV room on decode pods ----------------------------------------------------------
    def book_kv(self, pod_id: str, tokens: float) -> int:
        ticket = next(self._ids)
        self._pod(pod_id).kv[ticket] = float(tokens)
        if self.on_change is not None:
            self.on_change("book", pod_id, ticket, float(tokens), KV)
        return ticket

    def release_kv(self, pod_id: str, ticket: int) -> bool:
        led = self._pods.get(pod_id)
        tokens = led.kv.pop(ticket, None) if led is not None else None
        if tokens is None:
            return False
        if self.on_change is not None:
            self.on_change("release", pod_id, ticket, tokens, KV)
        return True

    def kv_booked(self, pod_id: str) -> tuple[int, float]:
        """(requests, tokens) of KV booked on ``pod_id`` and not yet released."""
        led = self._pods.get(pod_id)
        return (len(led.kv), sum(led.kv.values())) if led and led.kv else (0, 0.0)

    # ---- foreign bookings (other router processes, via router/bookbus.py) ------------------
    def apply_foreign(self, origin: str, event: str, pod_id: str, ticket: int, tokens: float = 0.0,
                      resource: str = PREFILL, max_per_origin: int | None = None) -> bool:
        """Hold (``event`` "book") or give back ("release") another process's booking. Idempotent;
        False when nothing changed, or when ``origin`` already holds ``max_per_origin`` bookings."""
        held = self._foreign.setdefault(origin, {})
        k = (pod_id, resource, ticket)
        if event == "book":
            if k in held or (max_per_origin is not None and len(held) >= max_per_origin):
                return False
            held[k] = float(tokens)
            if resource == KV:
                self._pod(pod_id).kv[(origin, ticket)] = float(tokens)
            else:
                self._add_prefill(pod_id, (origin, ticket), float(tokens))
            return True
        if held.pop(k, None) is None:
            return False
        if resource == KV:
            led = self._pods.get(pod_id)
            if led is not None:
                led.kv.pop((origin, ticket), None)
        else:
            self._pop_prefill(pod_id, (origin, ticket))
        led = self._pods.get(pod_id)
        if led is not None and not led.bookings and not led.kv:
            # a peer may name any pod (one of its fleet this one lacks, or a forged name on an unkeyed
            # bus): an empty entry goes, so what the ledger holds is bounded by the bookings held
            del self._pods[pod_id]
        return True

    def replace_origin(self, origin: str, bookings: list[tuple[str, int, float, str]],
                       max_per_origin: int | None = None) -> tuple[int, int]:
        """Make ``origin``'s foreign bookings exactly ``bookings`` [(pod, ticket, tokens, resource)]
        (its full snapshot). Returns (added, released): what the snapshot repaired."""
        held = self._foreign.get(origin, {})
        wanted = {(pod, res, int(ticket)): float(tokens) for pod, ticket, tokens, res in bookings}
        released = 0
        for pod, res, ticket in [k for k in held if k not in wanted]:
            released += self.apply_foreign(origin, "release", pod, ticket, resource=res)
        added = 0
        for (pod, res, ticket), tokens in wanted.items():
            added += self.apply_foreign(origin, "book", pod, ticket, tokens, res, max_per_origin)
        return added, released

    def forget_origin(self, origin: str) -> int:
        """Drop every booking of ``origin`` (it went silent or stopped); how many there were."""
        held = list(self._foreign.get(origin, {}))
        for pod, res, ticket in held:
            self.apply_foreign(origin, "release", pod, ticket, resource=res)
        self._foreign.pop(origin, None)
        return len(held)

    def foreign_count(self, origin: str | None = None) -> int:
        """Foreign bookings held (for ``origin``, or for all)."""
        if origin is not None:
            return len(self._foreign.get(origin, {}))
        return sum(len(h) for h in self._foreign.values())

    def local_bookings(self) -> list[tuple[str, int, float, str]]:
        """This process's open bookings, [(pod, ticket, tokens, resource)]: what its snapshot says."""
        out: list[tuple[str, int, float, str]] = []
        for pid, led in self._pods.items():
            out.extend((pid, k, t, PREFILL) for k, t in led.bookings.items() if isinstance(k, int))
            out.extend((pid, k, t, KV) for k, t in led.kv.items() if isinstance(k, int))
        return out

    # ---- fleet ---------------------------------------------------------------------------
    def forget(self, pod_id: str) -> None:
        self._pods.pop(pod_id, None)
        for held in self._foreign.values():
            for k in [k for k in held if k[0] == pod_id]:
                del held[k]

    def totals(self) -> dict[str, tuple[int, float]]:
        return {pid: (len(led.bookings), led.tokens) for pid, led in self._pods.items()}

    def empty(self) -> bool:
        """Nothing booked anywhere by this process (every request it sent has ended)."""
        return not any(isinstance(k, int) for led in self._pods.values() for k in (*led.bookings, *led.kv))


@dataclass
class Booking:
    """One request's hold on the ledger, made by ``Router.book`` and released once by ``release``.

    ``pod_id`` is where the request is sent; ``prefill_pod`` the pod that computes its prompt (the
    same pod, or under P/D a prefill pod). ``work_tokens`` is the prefill work ahead of the first
    token on ``prefill_pod`` (its queue plus the request's own uncached tokens), which the
    calibrator divides by the observed time. ``Router.book`` builds it positionally: a new field
    goes there too, in the same place."""

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
    running: int = 0          # requests the prefilling pod was running when this one was routed
    model_ttft_s: float = 0.0  # the calibrated model's TTFT before its error correction (what it learns against)
    ttft_low_s: float = 0.0   # the predicted interval of the TTFT (ttft_interval_level)
    ttft_high_s: float = float("inf")
    keys: Sequence[int] = ()    # the prompt's block keys, to date their last use when it ends
    held: tuple[str, ...] = ()  # the pods that hold those blocks while it runs
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
