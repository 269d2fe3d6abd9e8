"""The index's large maps (indexer/bigmap.py) behave as the dicts they replace, against a dict model."""

from __future__ import annotations

import random
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.bigmap import SHARDS, SLOT, ChunkedOrder, ShardedMap

KEYS = st.one_of(st.integers(0, 40), st.integers(-(2**63), 2**64 - 1))

order_op = st.one_of(
    st.tuples(st.just("refresh"), st.lists(KEYS, max_size=12), st.integers(0, 20), st.integers(0, 20)),
    st.tuples(st.just("refresh"), st.lists(st.integers(0, 12), max_size=20), st.integers(0, 20),
              st.integers(0, 20)),                                                   # with repeats
    st.tuples(st.just("pop"), KEYS),
    st.tuples(st.just("pop_oldest"), st.integers(0, 15)),
    st.tuples(st.just("remove_many"), st.lists(KEYS, max_size=10)),
)


def check_invariants(co: ChunkedOrder, model: dict) -> None:
    assert len(co) == len(model) and bool(co) == bool(model)
    assert list(co.items()) == list(model.items())          # the same order, oldest first
    assert list(co) == list(model) and list(co.values()) == list(model.values())
    for c, chunk in co.chunks.items():
        assert len(chunk) <= co.size
        assert chunk or c == co.tail                         # an emptied chunk is dropped unless it takes new keys
        for k in chunk:
            assert co.where.get(k) == c
        assert all(v >= co.low[c] for v in chunk.values())  # the bound that lets fresh chunks be skipped
    assert set(co.low) == set(co.chunks) == set(co.room)
    assert len(co.where) == len(model)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.lists(order_op, max_size=80))
def test_a_chunked_order_is_an_insertion_ordered_dict(size, ops):
    co = ChunkedOrder(chunk=size)
    model: dict = {}
    marks: ShardedMap = ShardedMap()   # bit 1 set on every key the order holds (as the index's predicted map)
    marks[12345] = 2                   # another source's mark, never touched
    for o in ops:
        if o[0] == "refresh":
            _, keys, value, fresh = o
            expect = []
            for k in keys:   # one after the other: a repeat finds the first's value
                if k not in model:
                    expect.append(k)
                elif model[k] >= fresh:
                    continue          # fresh enough: keeps its place and value
                model.pop(k, None)
                model[k] = value
            assert co.refresh(keys, value, fresh, marks, 1)[0] == len(expect)
        elif o[0] == "pop":
            assert co.pop(o[1], "absent") == model.pop(o[1], "absent")
            marks.clear_bits([o[1]], 1)
        elif o[0] == "remove_many":
            assert co.present(o[1]) == [k for k in o[1] if k in model]
            co.remove_many(o[1])
            marks.clear_bits(o[1], 1)
            for k in o[1]:
                model.pop(k, None)
        else:
            victims = list(model)[: o[1]]
            assert co.pop_oldest(o[1], marks, 1) == len(victims)
            for k in victims:
                del model[k]
        for k in (0, 1, 7):
            assert co.get(k) == model.get(k) and (k in co) == (k in model)
        check_invariants(co, model)
        assert dict(marks.items()) == {**dict.fromkeys(model, 1), 12345: 2 | (1 if 12345 in model else 0)}


def test_a_chunk_that_has_mostly_emptied_gives_its_room_back():
    co = ChunkedOrder(chunk=512)
    co.refresh(list(range(1024)), 1.0, 2.0, ShardedMap(), 1)  # two full chunks
    first = co.chunks[0]
    before = sys.getsizeof(first)
    co.remove_many(range(0, 512 - 512 // 8))                 # down to an eighth of the first chunk
    assert co.chunks[0] is not first and sys.getsizeof(co.chunks[0]) < before / 4
    assert list(co) == list(range(512 - 64, 1024))
    co.remove_many(range(512 - 64, 512))
    assert 0 not in co.chunks and list(co.chunks) == [1]     # emptied: dropped whole


def test_the_oldest_are_found_without_walking_the_evicted():
    """The reason for chunks: after many evictions from the front, reading the oldest entries visits
    only the live chunks' entries, not every entry evicted since the last rebuild (a dict's holes)."""
    co = ChunkedOrder(chunk=64)
    marks: ShardedMap = ShardedMap()
    co.refresh(list(range(64)), 0.0, 1.0, marks, 1)
    nxt = 64
    for _ in range(200):
        co.refresh(list(range(nxt, nxt + 64)), 0.0, 1.0, marks, 1)
        nxt += 64
        assert co.pop_oldest(64, marks, 1) == 64 and list(co) == list(range(nxt - 64, nxt))
    assert set(marks) == set(range(nxt - 64, nxt))
    assert len(co) == 64 and len(co.chunks) <= 2
    assert all(len(c) <= 64 for c in co.chunks.values())


shard_op = st.one_of(
    st.tuples(st.just("set"), KEYS, st.integers()),
    st.tuples(st.just("or"), st.lists(KEYS, max_size=8), st.integers(0, 8)),
    st.tuples(st.just("clear"), st.lists(KEYS, max_size=8), st.integers(0, 8)),
    st.tuples(st.just("pop"), KEYS),
    st.tuples(st.just("del"), KEYS),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(shard_op, max_size=60))
def test_a_sharded_map_is_a_dict(ops):
    sm: ShardedMap = ShardedMap()
    model: dict = {}
    for o in ops:
        if o[0] == "set":
            sm[o[1]] = o[2]
            model[o[1]] = o[2]
        elif o[0] == "or":
            bit = 1 << o[2]
            sm.or_bits(o[1], bit)
            for k in o[1]:
                model[k] = model.get(k, 0) | bit
        elif o[0] == "clear":
            bit = 1 << o[2]
            sm.clear_bits(o[1], bit)
            for k in o[1]:
                if k in model:
                    model[k] &= ~bit
                    if not model[k]:
                        del model[k]
        elif o[0] == "pop":
            assert sm.pop(o[1], None) == model.pop(o[1], None)
        elif o[1] in model:
            del sm[o[1]]
            del model[o[1]]
        assert len(sm) == len(model) and bool(sm) == bool(model)
        assert dict(sm.items()) == model and set(sm) == set(model)
    copy = sm.copy()
    copy[12345] = 1
    assert 12345 not in sm or model.get(12345) == sm[12345]
    assert all(k in sm.parts[sm.route[k & SLOT]] for k in model) and len(sm.parts) == SHARDS
    assert "not an int" not in sm


def test_shards_are_of_sizes_spread_over_an_octave_so_they_do_not_rebuild_together():
    """Equal shards fill in step and CPython rebuilds them at the same moment (one call paid for
    nearly all: bench/index_churn.py); the route gives shard i a share growing as 2 ** (i / n)."""
    sm: ShardedMap = ShardedMap()
    rng = random.Random(0)
    for _ in range(200_000):   # 64-bit keys, as block hashes are
        sm[rng.getrandbits(64)] = 1
    sizes = [len(p) for p in sm.parts]
    assert sum(sizes) == len(sm) and 1.7 < max(sizes) / min(sizes) < 2.4
    assert sizes.index(min(sizes)) < 8 and sizes.index(max(sizes)) >= SHARDS - 8
    assert len(ShardedMap(shards=3).parts) == 3 and ShardedMap([(5, 1)], shards=1).parts == [{5: 1}]
    try:
        ShardedMap(shards=0)
    except ValueError as e:
        assert "shards must be" in str(e)
    else:
        raise AssertionError("0 shards accepted")
