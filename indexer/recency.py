"""Which cached blocks a pod should have evicted by the time a queued request starts there.

vLLM looks a request's prefix up when it schedules it, not when it arrives. A finished request's
blocks stay cached in an LRU free queue (freed tail block first, so a prefix shrinks from its end)
and are evicted from the queue's head as the pod needs room. The index knows which blocks a pod
holds *now*; a follow-up that waits behind others can find the end of its history gone by the time
it is scheduled, and the engine computes it again while the router had counted it cached. Per pod,
this module keeps what the router needs to see that coming:

* each block's **last use**: held (``HELD``) from the moment a request containing it is booked on
  the pod, then the time that request ended (``hold`` / ``release``);
* the blocks idle since each end time (``idle``: the LRU queue as the router knows it, oldest first);
* the **eviction rate**: blocks per second in the pod's BlockRemoved events over ``RATE_WINDOW_S``.

``surviving(pod, keys, depth, at)`` spends the evictions the rate gives until ``at`` on the idle
blocks in that order (a request's last block first) and returns how much of a ``depth``-block
match is left. A block's key is chained over its whole prefix, so a request that used block *i*
also used every block before it: along a prompt the last-use times fall, and what survives is a
prefix of the match.

**The self-check.** The router routes a request expecting part of its match to be evicted first
(``expect_evicted``): if the engine then announces one of those blocks again (``stored``: it
computed it again), the expectation held; if not within the given time, it did not. ``precision``
is a cautious estimate of how often it holds lately, and the router counts only that share of the
expected loss: a pod that looks prefixes up on arrival (the simulator's ``seed`` timing) refutes
the expectations and the cut fades. Memory is bounded per pod (the oldest entries go first) and
in the checks in flight.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from itertools import groupby, islice, repeat

HELD = math.inf
# past a cap, entries go oldest first, down to 1/16 under the cap but at most this many at a time: one
# batch is one stall of the event loop: ~0.6-1 us an entry (62,500 at a 1M cap took ~37 ms, 1,024 ~1 ms)
EVICT_BATCH = 1024
RATE_WINDOW_S = 5.0  # the eviction rate is the blocks evicted per second over this window
MAX_WATCHED = 10_000  # self-checks in progress, at most
CHECK_KINDS = ("eviction_checks_confirmed", "eviction_checks_refuted", "eviction_checks_dropped")
CHECK_DECAY = 0.99  # each outcome weighs this much less per later one (about the last 100 count)


class _PodRecency:
    __slots__ = ("last", "idle", "removals", "removed")

    def __init__(self) -> None:
        self.last: dict[int, float] = {}     # key -> when the request that last held it ended (HELD: in use)
        self.idle: dict[float, int] = {}     # end time -> blocks of that request still idle, oldest first
        self.removals: deque[tuple[float, int]] = deque()  # (when, blocks) evicted within RATE_WINDOW_S
        self.removed = 0                     # blocks in ``removals``


class BlockRecency:
    """Per-pod last use of each block and eviction rate (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], max_blocks_per_pod: int = 1_000_000,
                 counters: dict[str, int] | None = None):
        self.clock = clock
        self.max_blocks_per_pod = max(1, max_blocks_per_pod)
        self._pods: dict[str, _PodRecency] = {}
        # the self-check: (pod, key) of a block a routed request was expected to find
        # evicted -> until when its BlockStored (the engine computing it again) may come
        self._watch: dict[str, dict[int, float]] = {}
        self._deadlines: deque[tuple[float, str, int]] = deque()
        self.confirmed = self.refuted = 0.0   # decayed counts of the checks' outcomes
        # the checks' outcomes, counted in ``counters`` (the prefix index's: /metrics shows them)
        self.checks = counters if counters is not None else {}
        for kind in CHECK_KINDS:
            self.checks.setdefault(kind, 0)

    # --- the self-check ---------------------------------------------------------------------------
    def expect_evicted(self, pod_id: str, key: int, within_s: float) -> None:
        """A request was routed to ``pod_id`` expecting it to compute block ``key`` again (evicted
        before the request starts): watch for the pod's BlockStored of it for ``within_s``."""
        now = self.clock()
        self._expire(now)
        if len(self._deadlines) >= MAX_WATCHED:
            self.checks["eviction_checks_dropped"] += 1
            return
        self._watch.setdefault(pod_id, {})[key] = now + within_s
        self._deadlines.append((now + within_s, pod_id, key))

    def stored(self, pod_id: str, keys: Sequence[int]) -> None:
        """The pod stored these blocks: any watched among them was evicted and computed again."""
        w = self._watch.get(pod_id)
        if not w:
            return
        for k in w.keys() & set(keys):
            del w[k]
            self._outcome(True)

    def _expire(self, now: float) -> None:
        d = self._deadlines
        while d and d[0][0] < now:
            _, pod_id, key = d.popleft()
            w = self._watch.get(pod_id)
            if w is not None and w.get(key, math.inf) < now:
                del w[key]
                self._outcome(False)

    def _outcome(self, confirmed: bool) -> None:
        self.confirmed = self.confirmed * CHECK_DECAY + confirmed
        self.refuted = self.refuted * CHECK_DECAY + (not confirmed)
        self.checks["eviction_checks_confirmed" if confirmed else "eviction_checks_refuted"] += 1

    @property
    def watching(self) -> bool:
        return bool(self._deadlines)

    def precision(self) -> float:
        """How often an expected eviction has come true lately, at the least: the mean of a Beta(1, 1)
        prior updated by the decayed outcomes, less 1.28 standard deviations (about its 10th
        percentile), so the router acts on an expectation only as far as it has been shown to hold."""
        self._expire(self.clock())
        n = self.confirmed + self.refuted
        mean = (self.confirmed + 1.0) / (n + 2.0)
        return max(0.0, mean - 1.28 * math.sqrt(mean * (1.0 - mean) / (n + 3.0)))

    def _pod(self, pod_id: str) -> _PodRecency:
        p = self._pods.get(pod_id)
        if p is None:
            p = self._pods[pod_id] = _PodRecency()
        return p

    def hold(self, pod_id: str, keys: Sequence[int]) -> None:
        """A request containing ``keys`` was booked on the pod: its blocks are in use until it ends."""
        self._set(pod_id, keys, HELD)

    def release(self, pod_id: str, keys: Sequence[int]) -> None:
        """That request ended: its blocks are idle from now (unless another request still holds them;
        this one's end is then an early guess, and the other's end corrects it)."""
        self._set(pod_id, keys, self.clock())

    def _set(self, pod_id: str, keys: Sequence[int], t: float) -> None:
        if not keys:
            return
        p = self._pod(pod_id)
        last, idle = p.last, p.idle
        for old, n in _runs(last.get, keys):   # what these keys said before
            if old is not None and old != HELD:
                c = idle.get(old, 0) - n
                if c > 0:
                    idle[old] = c
                else:
                    idle.pop(old, None)
        last.update(zip(keys, repeat(t)))
        if t != HELD:
            idle[t] = idle.get(t, 0) + len(keys)
        if len(last) > self.max_blocks_per_pod:  # drop the oldest-inserted, a batch at a time
            cap = self.max_blocks_per_pod
            for k in list(islice(last, len(last) - cap + min(cap // 16, EVICT_BATCH))):
                old = last.pop(k)
                if old != HELD:
                    _unidle(idle, old)

    def removed(self, pod_id: str, keys: Sequence[int]) -> None:
        """The pod evicted these blocks."""
        p = self._pods.get(pod_id)
        if p is None:
            return
        pop, idle = p.last.pop, p.idle
        for k in keys:
            t = pop(k, None)
            if t is not None and t != HELD:
                _unidle(idle, t)
        now = self.clock()
        p.removals.append((now, len(keys)))
        p.removed += len(keys)
        self._trim(p, now)

    @staticmethod
    def _trim(p: _PodRecency, now: float) -> None:
        while p.removals and p.removals[0][0] < now - RATE_WINDOW_S:
            p.removed -= p.removals.popleft()[1]

    def forget(self, pod_id: str) -> None:
        """The pod's cache was cleared or the pod left."""
        self._pods.pop(pod_id, None)

    def eviction_rate(self, pod_id: str) -> float:
        """Blocks the pod evicted per second over the last ``RATE_WINDOW_S``."""
        p = self._pods.get(pod_id)
        if p is None:
            return 0.0
        self._trim(p, self.clock())
        return p.removed / RATE_WINDOW_S

    def surviving(self, pod_id: str, keys: Sequence[int], depth: int, at: float) -> int:
        """How many of the first ``depth`` blocks of ``keys`` the pod should still hold at ``at``:
        the pod goes on evicting at its recent rate until then, idle blocks in the order they were
        freed (a request's tail blocks first)."""
        p = self._pods.get(pod_id)
        if p is None or depth <= 0:
            return depth
        evict = self.eviction_rate(pod_id) * (at - self.clock())
        if evict < 1.0:
            return depth
        get = p.last.get
        ahead = None
        while depth > 0:
            t = get(keys[depth - 1], HELD)
            if t == HELD:
                return depth
            if ahead is None:
                ahead = sum(c for u, c in p.idle.items() if u < t)
            evict -= ahead
            if evict < 1.0:
                return depth
            # the blocks of this prompt freed at ``t``: keys[first:depth]
            lo, hi = 0, depth - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if get(keys[mid], HELD) > t:
                    lo = mid + 1
                else:
                    hi = mid
            batch = p.idle.get(t, 0)
            if evict < batch:  # the rest of the queue is reached within this batch: its tail goes
                return max(lo, depth - int(evict))
            evict -= batch
            ahead = 0
            depth = lo
        return depth

    def stats(self, pod_id: str) -> dict[str, float]:
        p = self._pods.get(pod_id)
        if p is None:
            return {"blocks": 0, "idle_blocks": 0, "eviction_rate": 0.0}
        return {"blocks": len(p.last), "idle_blocks": sum(p.idle.values()),
                "eviction_rate": self.eviction_rate(pod_id)}


def _runs(get: Callable[[int], float | None], keys: Sequence[int]) -> list[tuple[float | None, int]]:
    """The runs of equal last-use times along ``keys``, as (time, count), in C-level loops: along a
    prompt the times come in a few runs (the shared head most recent, then each earlier turn), and
    an 8k-token prompt has ~500 keys."""
    return [(v, len(list(g))) for v, g in groupby(map(get, keys))]


def _unidle(idle: dict[float, int], t: float) -> None:
    c = idle.get(t, 0) - 1
    if c > 0:
        idle[t] = c
    else:
        idle.pop(t, None)
