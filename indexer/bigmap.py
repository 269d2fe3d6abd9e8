"""Maps of block keys that stay stall-free at millions of entries.

A plain dict of a million entries costs the event loop in two ways that its averages hide:

* **Resizes.** A dict that grows past its room is rebuilt at once: 88 ms at 1.4M entries and 174 ms
  at 2.7M (a throwaway microbenchmark on this 2-core machine). Deleting does not give room back, so
  a dict that churns at a steady size (new blocks in, evicted blocks out) is rebuilt every time its
  room fills, again and again. A full index showed 40-150 ms loop stalls a few times a minute.
* **The front of an ordered dict.** A deleted entry leaves a hole in the dict's entry array until
  the next rebuild, and iteration walks the holes. Evicting the oldest 1,024 entries of a churning
  1M-entry dict by ``islice`` took 0.04 ms at first and 1-5 ms after 2,000 rounds: every eviction
  walked past every entry evicted before it.

:class:`ShardedMap` (unordered) splits the entries over ``SHARDS`` dicts by the key's low bits, so
one rebuild moves a 64th of them or so. :class:`ChunkedOrder` (insertion order, for a pod's
predicted entries and their expiry) keeps its values in chunks of at most ``CHUNK`` insertions,
oldest chunk first, and a ``ShardedMap`` from key to chunk: a chunk never grows past ``CHUNK``
entries, a chunk that empties is dropped whole, and the oldest entries are found without walking an
old chunk's holes. The order is exact, unlike sharding an ordered dict (each shard's own order is
only roughly the global one).

The price is Python-level work per key where one dict had C-level bulk updates: about a fifth more
per credited block, and half as much again for the any-tier masks of a 2,000-block BlockStored
(``bench/index_churn.py``; docs/indexer.md, "Maps that do not stall"). A source's engine-hash dict in
the index stays one dict for that reason.

Keys are ints (block keys and engine block hashes are 64-bit hashes; their low bits spread evenly).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice, repeat
from operator import and_
from typing import Any, Generic, TypeVar, overload

SHARDS = 64
SLOTS = 4096        # a key's low 12 bits pick its slot, and the slot its shard (``route``)
SLOT = SLOTS - 1    # hot loops write it as the literal 4095 (a global costs a lookup per key)
CHUNK = 4096  # insertions per chunk of a ChunkedOrder: a rebuild of a chunk moves at most this many
ABSENT = 1 << 62  # "in no chunk", above every chunk number

V = TypeVar("V")


def _route(shards: int) -> list[int]:
    """Slot -> shard, with shard ``i`` given a share of the slots growing as ``2 ** (i / shards)``:
    the largest shard gets about twice the smallest's keys. Equal shards fill in step and reach the
    size where CPython rebuilds a dict at the same moment, so one event would pay for rebuilding
    nearly all of them (a 15 ms call where one dict took 170); shards of sizes spread over an octave
    cross those sizes one after another."""
    weights = [2 ** (i / shards) for i in range(shards)]
    total = sum(weights)
    table: list[int] = []
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w / total * SLOTS
        table.extend([i] * (round(acc) - len(table)))
    random.Random(shards).shuffle(table)   # neighbouring keys (small ints in tests) to unrelated shards
    return table


ROUTE = _route(SHARDS)   # the default maps' table: ``parts[ROUTE[k & SLOT]]`` holds ``k``


class ShardedMap(Generic[V]):
    """An unordered ``int -> value`` map over ``shards`` dicts (``SHARDS`` by default). The dict
    methods the index uses, plus :meth:`or_bits` and :meth:`clear_bits` for its bulk updates.
    ``parts[route[k & SLOT]]`` is the dict holding ``k``; a hot loop may use it directly (``ROUTE``
    for a map of ``SHARDS``)."""

    __slots__ = ("parts", "route")

    def __init__(self, items: Iterable[tuple[int, V]] = (), shards: int = SHARDS) -> None:
        if not 1 <= shards <= SLOTS:
            raise ValueError(f"shards must be 1 to {SLOTS}")
        self.parts: list[dict[int, V]] = [{} for _ in range(shards)]
        self.route = ROUTE if shards == SHARDS else _route(shards)
        for k, v in items:
            self.parts[self.route[k & SLOT]][k] = v

    @overload
    def get(self, k: int) -> V | None: ...
    @overload
    def get(self, k: int, default: V) -> V: ...

    def get(self, k: int, default: V | None = None) -> V | None:
        return self.parts[self.route[k & SLOT]].get(k, default)

    def __getitem__(self, k: int) -> V:
        return self.parts[self.route[k & SLOT]][k]

    def __setitem__(self, k: int, v: V) -> None:
        self.parts[self.route[k & SLOT]][k] = v

    def __delitem__(self, k: int) -> None:
        del self.parts[self.route[k & SLOT]][k]

    def pop(self, k: int, default: Any = None) -> Any:
        return self.parts[self.route[k & SLOT]].pop(k, default)

    def __contains__(self, k: object) -> bool:
        return isinstance(k, int) and k in self.parts[self.route[k & SLOT]]

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def __bool__(self) -> bool:
        return any(self.parts)

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.parts)

    def items(self) -> Iterator[tuple[int, V]]:
        return chain.from_iterable(p.items() for p in self.parts)

    def values(self) -> Iterator[V]:
        return chain.from_iterable(p.values() for p in self.parts)

    def copy(self) -> ShardedMap[V]:
        new: ShardedMap[V] = ShardedMap(shards=len(self.parts))
        new.parts = [p.copy() for p in self.parts]
        return new

    def or_bits(self: ShardedMap[int], keys: Sequence[int], bit: int) -> None:
        """``self[k] |= bit`` for every key (absent keys start at 0)."""
        parts, route = self.parts, self.route
        for k in keys:   # a loop: chains of map() over the shards measured no faster
            p = parts[route[k & 4095]]
            p[k] = p.get(k, 0) | bit

    def clear_bits(self: ShardedMap[int], keys: Iterable[int], bit: int) -> None:
        """Clear ``bit`` in every key's value, dropping a key left at 0 (absent keys are skipped)."""
        parts, route = self.parts, self.route
        keep = ~bit
        for k in keys:
            p = parts[route[k & 4095]]
            m = p.pop(k, 0) & keep   # one lookup where no other bit is set (the usual case)
            if m:
                p[k] = m


class ChunkedOrder:
    """An insertion-ordered ``int -> float`` map, for a pod's predicted keys and their expiry times:
    :meth:`refresh` puts keys at the back, :meth:`pop_oldest` and :meth:`items` work from the front.
    See the module docstring for why it is not one dict.

    A chunk that falls to an eighth of the room it was built with, while others remain, is copied
    into a dict of its own size (and again at an eighth of that), so keys that stay for long (a
    conversation's prefix credited again every turn) do not each hold a whole chunk's room."""

    __slots__ = ("where", "chunks", "room", "low", "tail", "tail_used", "n", "size", "cut")

    def __init__(self, chunk: int | None = None) -> None:
        self.size = CHUNK if chunk is None else chunk   # insertions per chunk
        self.where: ShardedMap[int] = ShardedMap()   # key -> number of the chunk holding it
        self.chunks: dict[int, dict[int, float]] = {0: {}}   # chunk number -> key -> value, oldest first
        self.room = {0: self.size}            # chunk number -> the entries its dict was built for
        self.low = {0: math.inf}              # chunk number -> no value in it is lower
        self.tail = 0                         # the chunk taking new keys
        self.tail_used = 0                    # insertions into it so far
        self.n = 0
        self.cut = -1                         # the newest chunk pop_oldest has taken entries from

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __contains__(self, k: object) -> bool:
        return k in self.where

    def get(self, k: int, default: float | None = None) -> float | None:
        c = self.where.parts[ROUTE[k & SLOT]].get(k)
        return default if c is None else self.chunks[c][k]

    def pop(self, k: int, default: Any = None) -> Any:
        c = self.where.parts[ROUTE[k & SLOT]].get(k)
        if c is None:
            return default
        v = self.chunks[c][k]
        self.remove_many((k,))
        return v

    def remove_many(self, keys: Iterable[int]) -> None:
        """Remove every key listed (absent ones and repeats are skipped): one call for a batch."""
        parts, chunks = self.where.parts, self.chunks
        touched = set()
        gone = 0
        for k in keys:
            c = parts[ROUTE[k & SLOT]].pop(k, None)
            if c is not None:
                del chunks[c][k]
                touched.add(c)
                gone += 1
        self.n -= gone
        touched.discard(self.tail)
        for c in touched:
            self._shrunk(c, chunks[c])

    def _shrunk(self, c: int, chunk: dict[int, float]) -> None:
        left = len(chunk)
        if not left:
            del self.chunks[c]
            del self.room[c]
            del self.low[c]
        elif left * 8 <= self.room[c]:
            self.chunks[c] = dict(chunk)      # same order, a dict sized to what is left
            self.room[c] = left

    def refresh(self, keys: Sequence[int], value: float, fresh: float, marks: ShardedMap[int],
                bit: int) -> tuple[int, int]:
        """Set each key to ``value`` at the back, in order, except a key whose value is ``fresh`` or
        later already (it keeps its place), and set ``bit`` in ``marks`` for each key that was not
        there before (the index's any-pod map of predicted keys). Returns how many those were, and a
        chunk number that no chunk holding one of the keys afterwards is older than (see
        :meth:`intact_since`). One pass: the locator's slot read and written once, new entries into
        the tail chunk (small, in cache), the mark set in the same loop."""
        parts, chunks, route = self.where.parts, self.chunks, ROUTE
        oldest = self.tail
        if keys and keys[0] in parts[route[keys[0] & 4095]]:
            # a head that is here already (a follow-up's history): which chunk holds each key (ABSENT:
            # none), without a Python-level loop, to skip those in chunks whose oldest value is fresh
            # enough. Keys that start new (a new conversation, the new turn after a skipped head) are
            # not looked up twice: 0.3 µs a key in the router for nothing
            at = list(map(dict.get, map(parts.__getitem__, map(route.__getitem__, map(and_, keys, repeat(4095)))),
                          keys, repeat(ABSENT)))
            oldest = min(oldest, min(at))
            low = self.low
            keys = [k for k, c in zip(keys, at) if c == ABSENT or low[c] < fresh]
        mparts, mroute = marks.parts, marks.route
        new = 0
        touched: set[int] = set()
        tail, used, size = self.tail, self.tail_used, self.size
        chunk = chunks[tail]
        if keys and value < self.low[tail]:
            self.low[tail] = value
        for k in keys:
            i = k & 4095
            wp = parts[route[i]]
            c = wp.get(k)
            if c is None:
                new += 1
                mp = mparts[mroute[i]]
                mp[k] = mp.get(k, 0) | bit
            else:
                old = chunks[c]
                if old[k] >= fresh:
                    if c < oldest:
                        oldest = c
                    continue
                del old[k]
                if c != tail:
                    touched.add(c)
            if used >= size:
                self.tail_used = used
                self._new_tail()
                tail, used = self.tail, 0
                chunk = chunks[tail]
                self.low[tail] = value
            chunk[k] = value
            wp[k] = tail
            used += 1
        self.tail_used = used
        self.n += new
        touched.discard(tail)
        for c in touched:
            if c in chunks:
                self._shrunk(c, chunks[c])
        return new, oldest

    def intact_since(self, chunk: int) -> bool:
        """No entry has been taken from chunk number ``chunk`` or a later one (other than by
        :meth:`remove_many`): :meth:`pop_oldest` goes through the chunks oldest first."""
        return chunk > self.cut

    def pop_oldest(self, n: int, marks: ShardedMap[int], bit: int) -> int:
        """Remove the ``n`` oldest keys (fewer if there are fewer), clearing ``bit`` in ``marks`` for
        each (see :meth:`refresh`); returns how many went. A chunk taken whole is dropped whole."""
        mparts, mroute = marks.parts, marks.route
        keep = ~bit
        gone = 0
        parts, chunks = self.where.parts, self.chunks
        for c in list(chunks):
            want = n - gone
            if want <= 0:
                break
            chunk = chunks[c]
            self.cut = c
            if len(chunk) <= want:
                taken = list(chunk)
                if c == self.tail:
                    chunks[c] = {}
                    self.low[c] = math.inf
                else:
                    del chunks[c]
                    del self.room[c]
                    del self.low[c]
            else:
                taken = list(islice(chunk, want))
                for k in taken:
                    del chunk[k]
                if c != self.tail:
                    self._shrunk(c, chunk)
            route = ROUTE
            for k in taken:
                i = k & 4095
                del parts[route[i]][k]
                mp = mparts[mroute[i]]
                m = mp.pop(k, 0) & keep   # one lookup where no other pod holds it (the usual case)
                if m:
                    mp[k] = m
            gone += len(taken)
        self.n -= gone
        return gone

    def present(self, keys: Sequence[int]) -> list[int]:
        """The keys that are in the map, in order."""
        parts = self.where.parts
        return [k for k in keys if k in parts[ROUTE[k & SLOT]]]

    def _new_tail(self) -> None:
        self._shrunk(self.tail, self.chunks[self.tail])
        self.tail += 1
        self.chunks[self.tail] = {}
        self.room[self.tail] = self.size
        self.low[self.tail] = math.inf
        self.tail_used = 0

    def items(self) -> Iterator[tuple[int, float]]:
        """Oldest first."""
        return chain.from_iterable(c.items() for c in list(self.chunks.values()))

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(list(self.chunks.values()))

    def values(self) -> Iterator[float]:
        return chain.from_iterable(c.values() for c in list(self.chunks.values()))
