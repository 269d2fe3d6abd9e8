"""The booking bus (router/bookbus.py): router processes share ledger bookings over ZeroMQ.

Unit tests drive the Ledger's foreign-booking hooks and ``BookingBus.handle`` directly (no socket);
the e2e ones run buses on loopback, a peer in its own process (killed by PID), and
``kvroute serve --workers 2`` in front of simulated pods."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from array import array

import httpx
import msgspec
import pytest
import yaml
import zmq

from router.bookbus import (
    CREDIT_KEYS_PER_MESSAGE,
    TOKENS_PER_MESSAGE,
    TOPIC,
    BookingBus,
    BusKey,
    BusStats,
    Forwarder,
    encode,
)
from router.booking import KV, PREFILL, Ledger
from simulator.testing import running_sims
from tests.helpers import ROOT, free_ports, kvroute_process, until


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---- unit: the ledger's hooks --------------------------------------------------------------
def test_foreign_bookings_count_like_local_ones_and_local_semantics_stay():
    clock = Clock()
    changes: list[tuple] = []
    led = Ledger(clock, on_change=lambda *a: changes.append(a))
    t1 = led.book("p0", 1000)
    assert changes == [("book", "p0", t1, 1000.0, PREFILL)]
    assert led.apply_foreign("w2", "book", "p0", 7, 500)
    assert not led.apply_foreign("w2", "book", "p0", 7, 500)  # idempotent
    assert led.inflight("p0") == 2
    assert led.queued_tokens("p0", 1000.0) == 1500.0
    clock.t += 0.2  # the head (the local booking) is 200 tokens done
    assert led.queued_tokens("p0", 1000.0) == pytest.approx(1300.0)
    assert led.apply_foreign("w2", "book", "d0", 8, 300, KV)
    assert led.kv_booked("d0") == (1, 300.0)
    assert not led.empty()
    assert led.local_bookings() == [("p0", t1, 1000.0, PREFILL)]
    led.release("p0", t1)
    assert changes[-1] == ("release", "p0", t1, 1000.0, PREFILL)
    assert led.empty()  # only foreign bookings left: this process has nothing of its own in flight
    assert led.inflight("p0") == 1 and led.queued_tokens("p0", 1000.0) == 500.0
    assert led.apply_foreign("w2", "release", "p0", 7)
    assert not led.apply_foreign("w2", "release", "p0", 7)
    assert led.inflight("p0") == 0
    # a snapshot replaces what is held for the origin
    added, released = led.replace_origin("w2", [("p1", 9, 100.0, PREFILL), ("p1", 10, 50.0, PREFILL)])
    assert (added, released) == (2, 1)  # p1's two added, d0's KV booking released
    assert led.kv_booked("d0") == (0, 0.0) and led.inflight("p1") == 2
    assert led.foreign_count("w2") == 2
    assert led.forget_origin("w2") == 2 and led.inflight("p1") == 0 and led.foreign_count() == 0
    # bounded per origin
    assert [led.apply_foreign("w3", "book", "p0", i, 1, max_per_origin=3) for i in range(5)] == [True] * 3 + [False] * 2
    led.forget("p0")
    assert led.foreign_count("w3") == 0


def test_local_tickets_are_unchanged_by_foreign_bookings():
    led = Ledger()
    led.apply_foreign("x", "book", "p0", 1, 10)
    t = led.book("p0", 5)
    assert t == 1  # a local ticket and a foreign one with the same number do not collide
    assert led.inflight("p0") == 2
    assert led.release("p0", t) and led.inflight("p0") == 1


# ---- unit: the bus's receive side, frames handed in directly ----------------------------------
def test_handle_applies_messages_skips_duplicates_counts_gaps_and_bad_frames():
    clock = Clock()
    led = Ledger(clock)
    bus = BookingBus(led, origin="me", clock=clock, peer_timeout_s=3.0, max_bookings_per_origin=4)
    bus.handle(encode("b", "other", 1, ["p0", 1, 100.0, "p"]))
    bus.handle(encode("b", "other", 1, ["p0", 1, 100.0, "p"]))  # the same message by a second path
    assert led.inflight("p0") == 1 and bus.stats.get("stale", "dropped") == 1
    bus.handle(encode("b", "other", 4, ["p0", 2, 100.0, "p"]))  # 2 and 3 were lost
    assert bus.stats.get("lost", "dropped") == 2
    bus.handle(encode("r", "other", 5, ["p0", 1, "p"]))
    assert led.inflight("p0") == 1
    bus.handle(encode("b", "me", 1, ["p0", 99, 1.0, "p"]))  # our own, through the forwarder
    assert led.inflight("p0") == 1
    # a snapshot repairs a lost release and a lost book
    bus.handle(encode("s", "other", 6, [["p1", 3, 10.0, "p"], ["d0", 4, 20.0, "k"]]))
    assert led.inflight("p0") == 0 and led.inflight("p1") == 1 and led.kv_booked("d0") == (1, 20.0)
    assert bus.stats.repaired == 3
    # bad frames: counted and dropped, never raised
    bad = [[b"x"], [TOPIC, b"\xc1"], [TOPIC, msgspec.msgpack.encode([2, "b", "o", 1, []])],
           [TOPIC, msgspec.msgpack.encode([1, "b", "o", 1, ["p0", "t", 1, "p"]])],
           [TOPIC, msgspec.msgpack.encode([1, "z", "o", 1, []])], [TOPIC, msgspec.msgpack.encode({"a": 1})],
           [TOPIC, msgspec.msgpack.encode([1, "s", "o", 1, [["p0", 1, -5, "p"]]])],
           [TOPIC, msgspec.msgpack.encode([1, "r", "", 1, ["p0", 1, "p"]])], [TOPIC, b""], []]
    for frames in bad:
        bus.handle(frames)
    assert bus.stats.get("bad", "dropped") == len(bad)
    # bounded per origin: the fifth is dropped and counted
    bus.handle(encode("s", "big", 1, [["p2", i, 1.0, "p"] for i in range(6)]))
    assert led.foreign_count("big") == 4 and bus.stats.get("full", "dropped") == 2
    # silence: the origin's bookings go, and its late messages do not bring them back
    clock.t += 2.0
    bus.handle(encode("s", "big", 2, []))
    clock.t += 2.0
    assert bus.expire() == ["other"]
    assert led.foreign_count("other") == 0 and led.inflight("p1") == 0 and bus.stats.peer_timeouts == 1
    bus.handle(encode("b", "other", 7, ["p0", 5, 1.0, "p"]))
    assert led.foreign_count("other") == 0 and bus.stats.get("stale", "dropped") == 2
    assert set(bus.peers) == {"big"}
    # ... until a snapshot says it is alive (it was cut off, not dead): exactly what it holds now
    bus.handle(encode("s", "other", 8, [["p0", 6, 3.0, "p"]]))
    assert led.foreign_count("other") == 1 and led.inflight("p0") == 1 and set(bus.peers) == {"big", "other"}
    # what could not be held is not even read: a snapshot of 4 bookings and then 100,000 of anything
    # holds the 4 and counts the rest as full (checking them all held the loop 1.4 s at 800,000)
    full, bad = bus.stats.get("full", "dropped"), bus.stats.get("bad", "dropped")
    bus.handle(encode("s", "huge", 1, [["p3", i, 1.0, "p"] for i in range(4)] + [0] * 100_000))
    assert led.foreign_count("huge") == 4 and bus.stats.get("bad", "dropped") == bad
    assert bus.stats.get("full", "dropped") == full + 100_000


def test_a_receive_pass_yields_after_so_many_bytes_not_only_so_many_messages():
    # what a message costs to apply grows with its size: 256 full "m" messages in one turn took 6.65 s
    from router.bookbus import MAX_OPS, RECV_BATCH, RECV_BYTES

    class Sub:
        def __init__(self, frames):
            self.frames = list(frames)

        def recv_multipart(self, flags):
            if not self.frames:
                raise zmq.Again()
            return self.frames.pop(0)

    class Loop:
        later = 0

        def call_soon(self, fn):
            self.later += 1

    big = [encode("m", "other", i + 1, [["b", ["p0", i * MAX_OPS + j, 1.0, "p"]] for j in range(MAX_OPS)])
           for i in range(10)]
    size = sum(map(len, big[0]))
    bus = BookingBus(Ledger(), origin="me", max_bookings_per_origin=10**6)
    bus._sub, bus._loop = Sub(big), Loop()
    bus._readable()
    taken = -(-RECV_BYTES // size)   # the pass stops once it has taken RECV_BYTES
    assert taken < 10 and len(bus._sub.frames) == 10 - taken and bus._loop.later == 1
    small = [encode("b", "other", 100 + i, ["p1", i, 1.0, "p"]) for i in range(RECV_BATCH + 5)]
    bus._sub, bus._loop = Sub(small), Loop()
    bus._readable()
    assert len(bus._sub.frames) == 5 and bus._loop.later == 1   # small ones: RECV_BATCH a pass, as before


def test_a_peers_released_bookings_leave_no_ledger_entry_behind():
    # a peer may name any pod (its fleet's, or anything on an unkeyed bus): 500,000 book-and-release
    # pairs for pods this router never had left as many empty entries, which every snapshot then walked
    led = Ledger()
    ticket = led.book("p0", 5.0)
    for i in range(1000):
        led.apply_foreign("o", "book", f"pod-{i}", i, 10.0)
        led.apply_foreign("o", "release", f"pod-{i}", i)
        led.apply_foreign("o", "book", f"dec-{i}", i, 10.0, KV)
        led.apply_foreign("o", "release", f"dec-{i}", i, resource=KV)
    led.apply_foreign("o", "book", "p0", 1, 10.0)
    led.apply_foreign("o", "release", "p0", 1)
    assert led.totals() == {"p0": (1, 5.0)}   # the local booking's pod keeps its entry
    assert led.release("p0", ticket) and led.local_bookings() == []


def test_tokens_messages_reach_the_cache_only_when_well_formed_and_of_the_same_tokenizer():
    bus = BookingBus(Ledger(), origin="me")
    got: list = []
    chunks = [(7, array("I", [1, 2, 3]).tobytes()), ((1 << 64) - 1, array("I", [70000, 5]).tobytes())]
    body = ["fp", [[k, ids] for k, ids in chunks]]  # token ids as uint32 bytes (little-endian here)
    bus.handle(encode("t", "other", 1, body))
    assert bus.stats.get("tokens", "dropped") == 1  # nobody takes them: not sharing
    bus.on_tokens = lambda fp, c: fp == "fp" and not got.append(c)
    bus.handle(encode("t", "other", 2, body))
    assert got == [chunks] and bus.stats.get("tokens", "received") == 1
    bus.handle(encode("t", "other", 3, ["another tokenizer", body[1]]))
    assert len(got) == 1 and bus.stats.get("tokens", "dropped") == 2
    bad = [["fp"], ["fp", []], ["", body[1]], ["x" * 65, body[1]], ["fp", [[-1, b"\0" * 4]]],
           ["fp", [[1.5, b"\0" * 4]]], ["fp", [[1, b"\0" * 5]]], ["fp", [[1, b""]]], ["fp", [[True, b"\0" * 4]]],
           ["fp", [[1, "text"]]], ["fp", [[1, b"\0" * 4, 2]]], ["fp", [[1, b"\0" * 4 * (TOKENS_PER_MESSAGE + 1)]]],
           ["fp", [[i, b"\0" * 4] for i in range(TOKENS_PER_MESSAGE + 1)]]]
    for i, b in enumerate(bad):
        bus.handle(encode("t", "other", 4 + i, b))
    assert bus.stats.get("bad", "dropped") == len(bad) and len(got) == 1


@pytest.mark.parametrize("kind,name,hook", [("c", "credits", "on_credits"), ("w", "withdrawals", "on_withdrawals")])
def test_credits_and_withdrawals_reach_the_router_only_when_well_formed_and_of_the_same_key_space(kind, name, hook):
    bus = BookingBus(Ledger(), origin="me")
    got: list = []
    keys = [7, (1 << 60) - 1, 0]
    body = ["16:abc", [["pod-a", 3], ["pod-b", 1]], array("Q", [*keys, 9]).tobytes()]  # little-endian here
    bus.handle(encode(kind, "other", 1, body))
    assert bus.stats.get(name, "dropped") == 1  # nobody takes them: not sharing
    bus.key_space = "16:abc"
    setattr(bus, hook, lambda pod, k: got.append((pod, k)))
    bus.handle(encode(kind, "other", 2, body))
    assert got == [("pod-a", keys), ("pod-b", [9])] and bus.stats.get(name, "received") == 1
    bus.handle(encode(kind, "other", 3, ["64:abc", *body[1:]]))  # another block size (or Python's hash)
    assert len(got) == 2 and bus.stats.get(name, "dropped") == 2
    n = CREDIT_KEYS_PER_MESSAGE
    k8 = b"\0" * 8
    bad = [["16:abc", body[1]], ["16:abc", [], b""], ["", *body[1:]], ["x" * 65, *body[1:]],
           ["16:abc", [[1, 1]], k8], ["16:abc", [["", 1]], k8], ["16:abc", [["p" * 257, 1]], k8],
           ["16:abc", [["p", 1]], b"\0" * 12], ["16:abc", [["p", 0]], b""], ["16:abc", [["p", True]], k8],
           ["16:abc", [["p", 1, 1]], k8], ["16:abc", [["p", 2]], k8], ["16:abc", [["p", 1]], k8 * 2],
           ["16:abc", [["p", 1]], [1]], ["16:abc", [["p", n + 1]], k8 * (n + 1)],
           ["16:abc", [["p", 1]] * (n + 1), k8 * (n + 1)], "x", None]
    for i, b in enumerate(bad):
        bus.handle(encode(kind, "other", 4 + i, b))
    assert bus.stats.get("bad", "dropped") == len(bad) and len(got) == 2
    assert bus.stats.get(name, "received") == 1


def test_limits_messages_charge_the_callers_buckets_only_when_well_formed():
    bus = BookingBus(Ledger(), origin="me")
    got: list = []
    body = [["team-a", 3, 1200.5], ["anonymous", 0, -40]]
    bus.handle(encode("l", "other", 1, body))
    assert bus.stats.get("limits", "dropped") == 1  # nobody takes them: no buckets here
    bus.on_spent = lambda *charge: got.append(charge)
    bus.handle(encode("l", "other", 2, body))
    assert got == [("team-a", 3.0, 1200.5), ("anonymous", 0.0, -40.0)]
    assert bus.stats.get("limits", "received") == 1
    bad = [[], "x", [["team-a", 1]], [["", 1, 1]], [["k" * 257, 1, 1]], [[1, 1, 1]], [["k", True, 1]],
           [["k", 1, "1"]], [["k", 1, 1e12]], [["k", -1e12, 0]], [["k", float("nan"), 0]],
           [["k", 0, float("inf")]], [["k", 1, 1]] * 1025]
    for i, b in enumerate(bad):
        bus.handle(encode("l", "other", 3 + i, b))
    assert bus.stats.get("bad", "dropped") == len(bad) and len(got) == 2


# ---- e2e: buses on loopback --------------------------------------------------------------------
@contextlib.asynccontextmanager
async def two_buses(**kw):
    pa, pb = free_ports(2)
    a = BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{pa}"], sub_connect=[f"tcp://127.0.0.1:{pb}"], **kw)
    b = BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{pb}"], sub_connect=[f"tcp://127.0.0.1:{pa}"], **kw)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.origin in b.peers and b.origin in a.peers, 10, "the buses to hear each other")
        yield a, b
    finally:
        await a.stop()
        await b.stop()


async def test_bookings_and_releases_propagate_and_a_lost_message_is_repaired_by_the_next_snapshot():
    async with two_buses(snapshot_s=0.2, peer_timeout_s=5.0) as (a, b):
        ticket = a.ledger.book("p0", 800)
        kv = a.ledger.book_kv("d0", 300)
        await until(lambda: b.ledger.inflight("p0") == 1 and b.ledger.kv_booked("d0") == (1, 300.0), 5, "the booking")
        assert b.ledger.queued_tokens("p0", 1e-9) == pytest.approx(800.0)
        a.ledger.release("p0", ticket)
        a.ledger.release_kv("d0", kv)
        await until(lambda: b.ledger.inflight("p0") == 0 and b.ledger.kv_booked("d0") == (0, 0.0), 5, "the release")
        # a lost message: book with the hook off (nothing is published), the snapshot carries it
        hook, a.ledger.on_change = a.ledger.on_change, None
        lost = a.ledger.book("p1", 50)
        a.ledger.on_change = hook
        await until(lambda: b.ledger.inflight("p1") == 1, 5, "the snapshot to repair the lost booking")
        hook, a.ledger.on_change = a.ledger.on_change, None
        a.ledger.release("p1", lost)
        a.ledger.on_change = hook
        await until(lambda: b.ledger.inflight("p1") == 0, 5, "the snapshot to repair the lost release")
        assert b.stats.repaired >= 2
        # and both ways
        a_ticket = b.ledger.book("p0", 10)
        await until(lambda: a.ledger.inflight("p0") == 1, 5, "b's booking at a")
        b.ledger.release("p0", a_ticket)


async def test_the_changes_of_one_loop_turn_go_out_as_one_message_applied_in_order():
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        sent, got = a.stats.get("batch", "sent"), b.stats.get("book", "received")
        tickets = [a.ledger.book("p0", 100) for _ in range(5)]     # one loop turn: nothing sent yet
        a.ledger.release("p0", tickets[0])                          # booked and released unsent: neither goes
        kv = a.ledger.book_kv("d0", 300)
        a.ledger.release_kv("d0", kv)                               # nor a KV booking's pair
        a.ledger.book_kv("d0", 200)
        assert a.stats.get("book", "sent") == 0
        await until(lambda: b.ledger.inflight("p0") == 4 and b.ledger.kv_booked("d0") == (1, 200.0), 5, "the batch")
        assert a.stats.get("batch", "sent") == sent + 1 and a.stats.get("book", "sent") == 5
        assert a.stats.get("book", "coalesced") == 2 and a.stats.get("release", "coalesced") == 2
        assert b.stats.get("batch", "received") == 1 and b.stats.get("book", "received") == got + 5
        assert b.stats.get("release", "received") == 0
        assert sorted(t for _, _, t in b.ledger._foreign[a.origin]) == tickets[1:] + [kv + 1]  # a's open ones
        a.ledger.release("p0", tickets[1])                          # sent already: its release goes, alone
        await until(lambda: b.ledger.inflight("p0") == 3, 5, "the lone release")
        assert a.stats.get("batch", "sent") == sent + 1 and a.stats.get("release", "sent") == 1
        assert a.stats.get("release", "coalesced") == 2
    # a malformed batch is dropped whole, counted
    led = Ledger()
    bus = BookingBus(led, origin="me")
    for body in ([], [["b", "p0", 1, 1.0, "p"], ["x"]], [["r", "p0", True, "p"]], [["b"] * 9] * 5000):
        bus.handle([TOPIC, msgspec.msgpack.encode([1, "m", "o", 1, body])])
    assert bus.stats.get("bad", "dropped") == 4 and led.inflight("p0") == 0
    bus.handle(encode("m", "o", 1, [["b", "p0", 1, 1.0, "p"], ["b", "p0", 2, 1.0, "p"], ["r", "p0", 1, "p"]]))
    assert led.inflight("p0") == 1


async def test_a_busy_bus_sends_at_most_one_message_of_changes_per_interval():
    # the buses hear each other by a snapshot; the next comes 5 s later, after the 2 s interval
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0, min_interval_s=2.0) as (a, b):
        assert a.min_interval_s == 2.0
        sent = a.stats.get("book", "sent")
        first = a.ledger.book("p0", 100)  # after a quiet spell: out at the end of this loop turn
        await until(lambda: b.ledger.inflight("p0") == 1, 5, "the first booking")
        batches = a.stats.get("batch", "sent")
        a.ledger.book("p0", 100)          # within the interval: held back ...
        await asyncio.sleep(0.05)
        a.ledger.release("p0", first)     # ... with what comes after it
        a.ledger.book_kv("d0", 300)
        await asyncio.sleep(0.05)
        assert a.stats.get("book", "sent") == sent + 1 and b.ledger.inflight("p0") == 1
        await until(lambda: b.ledger.kv_booked("d0") == (1, 300.0), 5, "the held changes")
        assert a.stats.get("batch", "sent") == batches + 1 and a.stats.get("book", "sent") == sent + 3
        assert b.ledger.inflight("p0") == 1 and b.stats.get("release", "received") == 1


async def test_rate_limit_charges_are_summed_per_caller_and_leave_with_the_next_flush():
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        got: list = []
        b.on_spent = lambda *charge: got.append(charge)
        a.share_spent("team-a", 1.0, 0.0)     # a request admitted ...
        a.share_spent("team-a", 0.0, 500.0)   # ... its estimate charged ...
        a.share_spent("team-a", 0.0, -100.0)  # ... and settled lower
        a.share_spent("team-b", 1.0, 0.0)
        await until(lambda: len(got) == 2, 5, "the charges")
        assert sorted(got) == [("team-a", 1.0, 400.0), ("team-b", 1.0, 0.0)]
        assert a.stats.get("limits", "sent") == 1 and b.stats.get("limits", "received") == 1
        # the queue is bounded in callers: past it a new caller's charge is dropped and counted
        from router.bookbus import MAX_PENDING_SPENT, SPENT_PER_MESSAGE
        for i in range(MAX_PENDING_SPENT + 1):
            a.share_spent(f"k{i}", 1.0, 0.0)
        assert a.stats.get("limits", "dropped") == 1
        await until(lambda: len(got) == 2 + MAX_PENDING_SPENT, 5, "the bounded charges")
        assert a.stats.get("limits", "sent") == 1 + MAX_PENDING_SPENT // SPENT_PER_MESSAGE


async def test_tokenized_chunks_shared_from_another_thread_arrive_split_into_bounded_messages():
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        got: list = []
        b.on_tokens = lambda fp, c: fp == "fp" and not got.extend(c)
        chunks = [(k, array("I", range(k, k + 100)).tobytes()) for k in range(200)]  # 20,000 tokens: 3 messages
        await asyncio.to_thread(a.share_tokens, "fp", chunks)  # as a tokenize thread does
        await until(lambda: len(got) == len(chunks), 5, "the chunks")
        assert got == chunks
        assert a.stats.get("tokens", "sent") == 3 and b.stats.get("tokens", "received") == 3


async def test_chunks_shared_within_an_interval_leave_together_with_the_bookings_and_the_queue_is_bounded():
    from router.bookbus import MAX_PENDING_TOKENS

    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0, min_interval_s=2.0) as (a, b):
        got: list = []
        b.on_tokens = lambda fp, c: fp == "fp" and not got.extend(c)
        a.ledger.book("p0", 100)  # after a quiet spell: out at the end of this loop turn
        await until(lambda: b.ledger.inflight("p0") == 1, 5, "the first booking")
        before = a.stats.get("tokens", "sent")
        # one stored batch per request, as a busy router stores them: held back within the interval
        turns = [[(100 * t + k, array("I", range(k, k + 50)).tobytes()) for k in range(4)] for t in range(30)]
        for chunks in turns[:20]:
            a.share_tokens("fp", chunks)
        for chunks in turns[20:]:
            await asyncio.to_thread(a.share_tokens, "fp", chunks)  # and from a tokenize thread
        a.ledger.book("p0", 100)
        await asyncio.sleep(0.3)
        assert got == [] and a.stats.get("tokens", "sent") == before
        await until(lambda: len(got) == 120 and b.ledger.inflight("p0") == 2, 5, "the held chunks and booking")
        assert got == [c for chunks in turns for c in chunks]   # in order
        assert a.stats.get("tokens", "sent") == before + 1     # 6,000 token ids: one message
        # more than the queue holds before the next flush: the rest is dropped and counted
        big = [(10_000 + k, array("I", range(4096)).tobytes()) for k in range(MAX_PENDING_TOKENS // 4096 + 3)]
        a.share_tokens("fp", big)
        assert a.stats.get("tokens", "dropped") == 3
        await until(lambda: len(got) == 120 + len(big) - 3, 5, "the chunks that fit")
        assert [k for k, _ in got[120:]] == [k for k, _ in big[:-3]]
        assert a.stats.get("tokens", "sent") == before + 1 + MAX_PENDING_TOKENS // 8192


async def test_credits_leave_with_the_next_flush_in_bounded_messages_and_the_queue_is_bounded():
    from router.bookbus import MAX_PENDING_CREDIT_KEYS

    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        got: list = []
        a.key_space = b.key_space = "16:abc"
        b.on_credits = lambda pod, keys: got.append((pod, keys))
        prompts = [("p0", list(range(k * 1000, k * 1000 + 700))) for k in range(30)]  # 21,000 keys: 2 messages
        for pod, keys in prompts:   # one loop turn: they leave together at its end
            a.share_credit(pod, keys)
        assert a.stats.get("credits", "sent") == 0
        await until(lambda: len(got) == len(prompts), 5, "the credits")
        assert got == prompts and a.stats.get("credits", "sent") == 2 and b.stats.get("credits", "received") == 2
        # a prompt longer than a message sends its first blocks; past the queue's bound a credit is dropped
        a.share_credit("p1", list(range(CREDIT_KEYS_PER_MESSAGE + 50)))
        for k in range(MAX_PENDING_CREDIT_KEYS // CREDIT_KEYS_PER_MESSAGE):
            a.share_credit("p2", list(range(k, k + CREDIT_KEYS_PER_MESSAGE)))
        assert a.stats.get("credits", "dropped") == 1
        await until(lambda: len(got) == len(prompts) + MAX_PENDING_CREDIT_KEYS // CREDIT_KEYS_PER_MESSAGE, 5, "more")
        assert got[len(prompts)] == ("p1", list(range(CREDIT_KEYS_PER_MESSAGE)))


@pytest.mark.parametrize("events", [True, False], ids=["events", "no events"])
async def test_a_routers_credit_reaches_the_other_routers_index_over_the_bus(events):
    """Router a routes a prompt (plan, then book): the blocks it credits to the chosen pod reach
    router b over the bus, so b sees them cached there and sends a follow-up to that pod, with or
    without the pods' KV events. A router not wired to the bus sees nothing cached."""
    import time

    from indexer.keys import key_space
    from router.config import PodConfig
    from whatif.simulate import SimConfig, _build_router

    cfg = SimConfig(pods=2, objective_s=None)
    if not events:
        cfg.router = {"pods": [PodConfig(id=pid, url=f"http://{pid}.simulated:8000", role=role, model=cfg.model)
                               for pid, role in cfg.pod_ids()]}
    ra, rb, alone = (_build_router(cfg, time.monotonic) for _ in range(3))
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        for router, bus in ((ra, a), (rb, b)):  # as router/service.py wires them
            bus.key_space = key_space(router.block_size)
            bus.on_credits = router.credit_foreign
            router.on_credit = bus.share_credit
        prompt = list(range(1, 2001))
        plan = ra.plan("completion", {"model": cfg.model, "prompt": prompt, "max_tokens": 1}, {})
        pod = plan.decision.chosen.pod_id
        ra.book(plan, plan.decision.chosen)
        follow_up = {"model": cfg.model, "prompt": prompt + list(range(5000, 5100)), "max_tokens": 1}
        full = len(prompt) // ra.block_size * ra.block_size

        def cached(router) -> int:
            return router.plan("completion", follow_up, {}, dry_run=True).snapshot.candidate(pod).cached_tokens

        await until(lambda: cached(rb) == full, 5, "a's credit at b")
        assert rb.plan("completion", follow_up, {}, dry_run=True).decision.chosen.pod_id == pod
        assert cached(alone) == 0 and b.stats.get("credits", "received") == 1
        other = next(p for p in rb.registry.pods if p != pod)
        rb.credit_foreign("no-such-pod", [1, 2, 3])   # a pod this router does not know: skipped
        assert rb.index.match([1, 2, 3]).get(other) is None or rb.index.match([1, 2, 3])[other].blocks == 0


async def test_bad_frames_on_the_wire_are_counted_and_the_bus_keeps_working():
    (port,) = free_ports(1)
    bus = BookingBus(Ledger(), sub_connect=[f"tcp://127.0.0.1:{port}"])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    await bus.start()
    try:
        async def send_until(frames, pred, what):
            async def step():
                pub.send_multipart(frames)
                await asyncio.sleep(0.05)
                return pred()
            for _ in range(200):  # PUB/SUB: the first messages go before the subscription arrives
                if await step():
                    return
            raise AssertionError(what)

        await send_until([TOPIC, b"\xff\x00garbage"], lambda: bus.stats.get("bad", "dropped") > 0, "a bad frame")
        await send_until([TOPIC], lambda: bus.stats.get("bad", "dropped") > 1, "a short message")
        await send_until(encode("b", "x", 1, ["p0", 1, 5.0, "p"]), lambda: bus.ledger.inflight("p0") == 1,
                         "a good frame after the bad ones")
    finally:
        await bus.stop()
        pub.close(linger=0)
        ctx.term()


PEER = textwrap.dedent("""
    import asyncio, sys
    from router.bookbus import BookingBus
    from router.booking import Ledger

    async def main():
        bus = BookingBus(Ledger(), pub_bind=[sys.argv[1]], snapshot_s=0.1)
        await bus.start()
        for i in range(int(sys.argv[2])):
            bus.ledger.book(f"p{i % 2}", 100)
        print(bus.origin, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def start_peer(endpoint: str, bookings: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", PEER, endpoint, str(bookings)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    origin = proc.stdout.readline().strip()
    assert origin, "the peer process did not start"
    return proc, origin


async def test_a_killed_peer_loses_its_bookings_and_a_restarted_one_does_not_bring_them_back():
    (port,) = free_ports(1)
    ep = f"tcp://127.0.0.1:{port}"
    bus = BookingBus(Ledger(), sub_connect=[ep], snapshot_s=0.1, peer_timeout_s=0.6)
    await bus.start()
    procs: list[subprocess.Popen] = []
    try:
        proc, first = start_peer(ep, 6)
        procs.append(proc)
        await until(lambda: bus.ledger.foreign_count(first) == 6, 10, "the peer's bookings")
        assert bus.ledger.inflight("p0") == 3 and bus.ledger.inflight("p1") == 3
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        await until(lambda: bus.ledger.foreign_count() == 0, 10, "the dead peer's bookings to go")
        assert first not in bus.peers and bus.stats.peer_timeouts == 1
        proc, second = start_peer(ep, 2)  # restarted on the same endpoint: a new origin, only its new bookings
        procs.append(proc)
        assert second != first
        await until(lambda: bus.ledger.foreign_count(second) == 2, 10, "the restarted peer's bookings")
        await asyncio.sleep(0.3)
        assert bus.ledger.foreign_count(first) == 0 and bus.ledger.inflight("p0") + bus.ledger.inflight("p1") == 2
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(10)
        await bus.stop()


async def test_workers_share_bookings_through_the_forwarder():
    fwd = Forwarder().start()
    buses = [BookingBus(Ledger(), pub_connect=[fwd.pub_endpoint], sub_connect=[fwd.sub_endpoint], snapshot_s=0.1)
             for _ in range(3)]
    try:
        for b in buses:
            await b.start()
        await until(lambda: all(len(b.peers) == 2 for b in buses), 10, "every worker to hear the other two")
        for i, b in enumerate(buses):
            b.ledger.book("p0", 100 * (i + 1))
        await until(lambda: all(b.ledger.inflight("p0") == 3 for b in buses), 5, "every booking everywhere")
        assert all(b.ledger.queued_tokens("p0", 1e-9) == pytest.approx(600.0) for b in buses)
    finally:
        for b in buses:
            await b.stop()
        fwd.stop()


def fresh_key() -> BusKey:
    return BusKey.from_secret(zmq.curve_keypair()[1].decode())


def outsider(kind: int, server_public: bytes) -> zmq.Socket:
    """A socket with a CURVE pair of its own that knows the bus's public key."""
    sock = zmq.Context.instance().socket(kind)
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    sock.setsockopt(zmq.LINGER, 0)
    return sock


async def test_with_a_curve_key_only_its_holders_publish_or_read_bookings():
    """Replicas sharing one key hear each other; a publisher without the key or with another one is
    not heard when a replica subscribes to it, and it cannot read a replica's bookings either."""
    key = fresh_key()
    pr, po = free_ports(2)
    rogues = [BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{pr}"], snapshot_s=0.1),
              BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{po}"], snapshot_s=0.1, key=fresh_key())]
    for r in rogues:
        await r.start()
    try:
        async with two_buses(snapshot_s=0.1, peer_timeout_s=5.0, key=key) as (a, b):
            for r in rogues:
                r.set_peers(a.bound)  # they try to read a
                r.ledger.book("p9", 10_000)  # and to write into a
            a.set_peers([f"tcp://127.0.0.1:{pr}", f"tcp://127.0.0.1:{po}"])
            # one who knows the public key (it is not secret) but holds another pair: ZAP turns it away
            spy = outsider(zmq.SUB, key.public)
            spy.setsockopt(zmq.SUBSCRIBE, b"")
            spy.connect(a.bound[0])
            ticket = a.ledger.book("p0", 800)
            await until(lambda: b.ledger.inflight("p0") == 1, 5, "a's booking at b, over CURVE")
            await asyncio.sleep(1.0)  # ten snapshot rounds of the rogues
            assert a.ledger.inflight("p9") == 0 and b.ledger.inflight("p9") == 0
            assert set(a.peers) == {b.origin}
            assert all(r.ledger.inflight("p0") == 0 and not r.peers for r in rogues)
            assert spy.poll(0) == 0  # not one of a's ten snapshots reached it
            spy.close(linger=0)
            a.ledger.release("p0", ticket)
            await until(lambda: b.ledger.inflight("p0") == 0, 5, "the release")
    finally:
        for r in rogues:
            await r.stop()


async def test_a_keyed_forwarder_takes_only_keyed_workers():
    key = fresh_key()
    fwd = Forwarder(key=key).start()
    workers = [BookingBus(Ledger(), pub_connect=[fwd.pub_endpoint], sub_connect=[fwd.sub_endpoint], snapshot_s=0.1,
                          key=key) for _ in range(2)]
    plain = BookingBus(Ledger(), pub_connect=[fwd.pub_endpoint], sub_connect=[fwd.sub_endpoint], snapshot_s=0.1)
    try:
        for w in [*workers, plain]:
            await w.start()
        plain.ledger.book("p9", 10_000)
        forger = outsider(zmq.PUB, key.public)  # knows the public key, not the secret: ZAP turns it away
        forger.connect(fwd.pub_endpoint)
        workers[0].ledger.book("p0", 100)
        await until(lambda: workers[1].ledger.inflight("p0") == 1, 10, "a keyed worker's booking at the other")
        for seq in range(1, 11):
            forger.send_multipart(encode("b", "forger", seq, ["p8", seq, 10_000, "p"]))
            await asyncio.sleep(0.1)
        forger.close(linger=0)
        assert all(w.ledger.inflight("p9") == 0 and w.ledger.inflight("p8") == 0 for w in workers)
        assert all(set(w.peers) == {o.origin for o in workers if o is not w} for w in workers)
        assert not plain.peers and plain.ledger.inflight("p0") == 0
    finally:
        for w in [*workers, plain]:
            await w.stop()
        fwd.stop()


def test_a_bus_key_is_checked_and_a_bad_one_is_not_echoed():
    from kvcommon.settings import build_settings, settings_error
    from router.config import RouterSettings

    public, secret = zmq.curve_keypair()
    assert BusKey.from_secret(secret.decode()).public == public
    bad = "x" * 39
    with pytest.raises(ValueError) as err:
        build_settings(RouterSettings, file_data={"booking_bus_curve_secret_key": bad})
    message = settings_error(err.value)
    assert "40 Z85 characters" in message and bad not in message


# ---- e2e: kvroute serve --workers 2 -------------------------------------------------------------
def scrape(text: str) -> tuple[str, float]:
    """(origin, sum of kvroute_pod_booked_requests) of one /metrics answer."""
    origin = re.search(r'kvroute_booking_bus_info\{origin="([^"]+)"\}', text)
    booked = sum(float(m) for m in re.findall(r"^kvroute_pod_booked_requests\{[^}]*\} (\S+)$", text, re.M))
    return (origin.group(1) if origin else ""), booked


@pytest.mark.parametrize("keyed", [False, True], ids=["clear", "curve"])
async def test_serve_with_two_workers_shares_bookings_between_them(tmp_path, keyed):
    """Curve: both workers' sockets take the key from the one setting."""
    (port,) = free_ports(1)
    key = {"booking_bus_curve_secret_key": zmq.curve_keypair()[1].decode()} if keyed else {}
    burst = 16
    # slow prefill so the burst's bookings stay open for seconds: 2 pods x 8 prompts of 2,000 tokens at 2,000/s
    with running_sims(2, ["--timing", "seed", "--prefill-tokens-per-s", "2000"]) as urls:
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({
            "port": port, "workers": 2, "prefill_tokens_per_s": 2000.0, "calibrate": False, **key,
            "pods": [{"id": f"sim-{i}", "url": u, "model": "sim-model"} for i, u in enumerate(urls)]}))
        base = f"http://127.0.0.1:{port}"
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=base + "/ready", timeout=40):
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                async def peers_up() -> bool:  # both workers up and hearing each other before the burst
                    seen = {}
                    for _ in range(12):
                        text = (await c.get(base + "/metrics")).text
                        seen[scrape(text)[0]] = "kvroute_booking_peers 1.0" in text
                    return len(seen) == 2 and all(seen.values())
                for _ in range(100):
                    if await peers_up():
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise AssertionError("the two workers never saw each other on the booking bus")
                body = {"model": "sim-model", "prompt": [1 + i for i in range(2000)], "max_tokens": 1, "stream": True}
                sends = [asyncio.create_task(c.post(base + "/v1/completions",
                                                    json={**body, "prompt": [7 * k + j for j in range(2000)]}))
                         for k in range(burst)]
                await asyncio.sleep(1.0)  # every request routed; the first answers take ~1 s, the last ~8 s
                views: dict[str, float] = {}
                frozen: dict[str, float] = {}
                for _ in range(20):
                    text = (await c.get(base + "/metrics")).text
                    origin, booked = scrape(text)
                    views[origin] = booked
                    got = re.search(r"^kvroute_gc_frozen_objects (\S+)$", text, re.M)
                    frozen[origin] = float(got.group(1)) if got else 0.0
                    if len(views) == 2:
                        break
                results = await asyncio.gather(*sends)
                assert all(r.status_code == 200 for r in results)
    assert len(views) == 2, f"/metrics reached one worker only: {views}"
    assert all(n > 10_000 for n in frozen.values()), frozen  # each worker froze its own start-up heap
    # each worker sees the whole burst booked (less what has had its first token already), not its share
    assert all(v >= burst - 3 for v in views.values()), views


async def test_serve_with_two_workers_beside_a_replica_goes_through_the_forwarder(tmp_path):
    """With replicas configured (``booking_bus_bind``, ``booking_bus_peers``) the workers share one
    outward endpoint, the parent's forwarder: a replica subscribed to it hears both workers, and each
    worker hears the other and the replica."""
    port, bind, other = free_ports(3)
    replica = BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{other}"],
                         sub_connect=[f"tcp://127.0.0.1:{bind}"], snapshot_s=0.1)
    await replica.start()
    try:
        with running_sims(1, ["--timing", "seed"]) as urls:
            cfg = tmp_path / "router.yaml"
            cfg.write_text(yaml.safe_dump({
                "port": port, "workers": 2, "booking_bus_bind": f"tcp://127.0.0.1:{bind}",
                "booking_bus_peers": [f"tcp://127.0.0.1:{other}"], "booking_bus_snapshot_s": 0.1,
                "pods": [{"id": "sim-0", "url": urls[0], "model": "sim-model"}]}))
            base = f"http://127.0.0.1:{port}"
            with kvroute_process(["serve", "--config", str(cfg)], ready_url=base + "/ready", timeout=40):
                await until(lambda: len(replica.peers) == 2, 20, "the replica to hear both workers")
                async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                    seen: dict[str, str] = {}
                    for _ in range(200):
                        text = (await c.get(base + "/metrics")).text
                        peers = re.search(r"^kvroute_booking_peers (\S+)$", text, re.M)
                        seen[scrape(text)[0]] = peers.group(1) if peers else ""
                        if len(seen) == 2 and all(v == "2.0" for v in seen.values()):
                            break
                        await asyncio.sleep(0.05)
        assert len(seen) == 2 and all(v == "2.0" for v in seen.values()), seen
    finally:
        await replica.stop()


async def test_serve_with_two_workers_sends_every_turn_of_a_conversation_to_its_pod(tmp_path):
    """Pods without KV events: the router knows what a pod holds only from its own credits. Each
    worker's credits reach the other over the bus, so every follow-up goes to the pod that holds its
    conversation, whichever worker routes it (without them, a follow-up on the other worker sees
    both pods empty and goes to either)."""
    (port,) = free_ports(1)
    with running_sims(2, ["--timing", "seed"]) as urls:
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({
            "port": port, "workers": 2, "calibrate": False,
            "pods": [{"id": f"sim-{i}", "url": u, "model": "sim-model"} for i, u in enumerate(urls)]}))
        base = f"http://127.0.0.1:{port}"
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=base + "/ready", timeout=40):
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                async def views() -> dict[str, str]:
                    seen = {}
                    for _ in range(12):
                        text = (await c.get(base + "/metrics")).text
                        seen[scrape(text)[0]] = text
                    return seen
                for _ in range(100):   # both workers up and hearing each other
                    seen = await views()
                    if len(seen) == 2 and all("kvroute_booking_peers 1.0" in t for t in seen.values()):
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise AssertionError("the two workers never saw each other on the booking bus")
                turns: dict[int, list[str]] = {}
                for conv in range(6):
                    prompt = [1000 * conv + j for j in range(2000)]
                    for turn in range(5):   # each on a new connection: either worker accepts it
                        r = await c.post(base + "/v1/completions", json={
                            "model": "sim-model", "prompt": prompt + list(range(100 * turn)), "max_tokens": 1})
                        assert r.status_code == 200, r.text
                        turns.setdefault(conv, []).append(r.headers["x-kvroute-pod"])
                        await asyncio.sleep(0.1)   # the bus's interval is 5 ms
                seen = await views()
    assert all(len(set(pods)) == 1 for pods in turns.values()), turns
    assert len(seen) == 2, "/metrics reached one worker only"
    received = [re.search(r'^kvroute_booking_bus_messages_total\{direction="received",kind="credits"\} (\S+)$',
                          text, re.M) for text in seen.values()]
    assert all(m is not None and float(m.group(1)) >= 1 for m in received), "a worker routed none of the turns"


async def test_replicas_follow_the_peer_list_a_resolver_gives():
    """Replicas: the SUB socket follows what ``resolve_peers`` answers (a headless Service re-resolved),
    and a failing resolver keeps the peers it had."""
    pa, pb, pc = free_ports(3)
    answers: list[list[str] | Exception] = [[f"tcp://127.0.0.1:{pb}"]]

    async def resolve() -> list[str]:
        answer = answers[-1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    a = BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{pa}"], resolve_peers=resolve, resolve_interval_s=0.1,
                   snapshot_s=0.1, peer_timeout_s=0.5)
    b = BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{pb}"], snapshot_s=0.1)
    c = BookingBus(Ledger(), pub_bind=[f"tcp://127.0.0.1:{pc}"], snapshot_s=0.1)
    for bus in (a, b, c):
        await bus.start()
    try:
        b.ledger.book("p0", 10)
        c.ledger.book("p0", 20)
        await until(lambda: a.ledger.foreign_count(b.origin) == 1, 5, "b's booking through the resolved peer")
        assert c.origin not in a.peers
        answers.append(OSError("resolver down"))
        await asyncio.sleep(0.4)
        assert a.connected == {f"tcp://127.0.0.1:{pb}"} and a.ledger.foreign_count(b.origin) == 1
        answers.append([f"tcp://127.0.0.1:{pa}", f"tcp://127.0.0.1:{pc}"])  # b gone, c in, a itself listed
        await until(lambda: a.ledger.foreign_count(c.origin) == 1 and a.ledger.foreign_count(b.origin) == 0, 5,
                    "c's booking in, b's out after the timeout")
        assert a.ledger.inflight("p0") == 1 and a.ledger.queued_tokens("p0", 1e-9) == pytest.approx(20.0)
    finally:
        for bus in (a, b, c):
            await bus.stop()


def test_build_bus_follows_the_settings():
    from kvcommon.settings import build_settings
    from router.config import RouterSettings
    from router.service import build_bus

    def settings(**kw):
        return build_settings(RouterSettings, file_data={"pods": [{"id": "a", "url": "http://127.0.0.1:1"}], **kw})

    assert build_bus(settings(), Ledger()) is None  # one process, no replicas: nothing to share
    worker = build_bus(settings(), Ledger(), ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
    assert worker.pub_connect == ["tcp://127.0.0.1:1"] and worker.static_peers == ["tcp://127.0.0.1:2"]
    assert worker.pub_bind == [] and worker.min_interval_s == 0.005
    assert build_bus(settings(booking_bus_min_interval_s=0), Ledger(), ("a", "b")).min_interval_s == 0
    sibling = build_bus(settings(), Ledger(), siblings="/run/kvroute-bus-x")  # workers without replicas
    assert sibling.pub_bind == [f"ipc:///run/kvroute-bus-x/{os.getpid()}"] and sibling.pub_connect == []
    assert sibling.static_peers == [] and sibling.siblings is not None and sibling.min_interval_s == 0.005
    with pytest.raises(ValueError):
        settings(booking_bus_min_interval_s=-1)
    assert build_bus(settings(booking_bus=False), Ledger(), ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")) is None
    replica = build_bus(settings(booking_bus_bind="tcp://*:5570", booking_bus_peers=["tcp://10.0.0.2:5570"],
                                 booking_bus_peers_dns="routers", booking_bus_snapshot_s=0.25), Ledger())
    assert replica.pub_bind == ["tcp://*:5570"] and replica.static_peers == ["tcp://10.0.0.2:5570"]
    assert replica.resolve_peers is not None and replica.snapshot_s == 0.25
    assert replica.key is None
    secret = zmq.curve_keypair()[1].decode()
    keyed = build_bus(settings(booking_bus_bind="tcp://*:5570", booking_bus_curve_secret_key=secret), Ledger())
    assert keyed.key == BusKey.from_secret(secret)
    with pytest.raises(ValueError):
        settings(booking_bus_peers=["10.0.0.2:5570"])


def test_a_worker_finds_its_live_siblings_sockets_and_not_its_own(tmp_path):
    from router.bookbus import sibling_endpoint, sibling_endpoints, siblings_directory

    own = sibling_endpoint(str(tmp_path))
    assert own == f"ipc://{tmp_path}/{os.getpid()}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    try:
        for name in (os.getpid(), other.pid, dead.pid, "notes.txt"):
            (tmp_path / str(name)).touch()
        assert sibling_endpoints(str(tmp_path), own) == [f"ipc://{tmp_path}/{other.pid}"]
    finally:
        other.kill()
        other.wait(10)
    assert sibling_endpoints(str(tmp_path / "gone"), own) == []
    made = siblings_directory()
    try:
        assert os.stat(made).st_mode & 0o777 == 0o700  # only this user may connect to the sockets
    finally:
        os.rmdir(made)


async def test_workers_reach_each_other_straight_through_their_sockets(tmp_path):
    """Workers' buses, each bound in the directory and finding the others there: every booking
    reaches the other workers and none comes back to its sender; a worker that joins late is found
    and hears the others (their snapshots)."""
    from router.bookbus import sibling_endpoint, sibling_endpoints

    def worker(pid: int) -> BookingBus:
        own = sibling_endpoint(str(tmp_path), pid)
        return BookingBus(Ledger(), pub_bind=[own], snapshot_s=0.1,
                          siblings=lambda: sibling_endpoints(str(tmp_path), own))

    late_pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    buses = [worker(os.getpid()), worker(os.getppid())]  # live pids: a dead one's socket is skipped
    try:
        for b in buses:
            await b.start()
        await until(lambda: all(len(b.peers) == 1 for b in buses), 10, "the two workers to hear each other")
        buses[0].ledger.book("p0", 100)
        buses[1].ledger.book("p0", 200)
        await until(lambda: all(b.ledger.inflight("p0") == 2 for b in buses), 5, "every booking everywhere")
        late = worker(late_pid.pid)
        await late.start()
        buses.append(late)
        await until(lambda: all(len(b.peers) == 2 for b in buses), 10, "the late worker to be found")
        await until(lambda: late.ledger.inflight("p0") == 2, 5, "the others' bookings at the late worker")
        late.ledger.book("p0", 300)
        await until(lambda: all(b.ledger.inflight("p0") == 3 for b in buses), 5, "the late worker's booking")
        assert all(b.stats.get("stale", "dropped") == 0 for b in buses)
        assert [b.stats.get("book", "received") for b in buses[:2]] == [2, 2]  # none heard its own
    finally:
        for b in buses:
            await b.stop()
        late_pid.kill()
        late_pid.wait(10)


@contextlib.asynccontextmanager
async def two_replicas(tmp_path, pods: list[dict], **settings):
    """Two ``kvroute serve`` replicas (A, B) in front of ``pods``, joined by the booking bus (each binds
    and names the other as its peer); yields their base URLs once each hears the other."""
    port_a, port_b, bus_a, bus_b = free_ports(4)
    with contextlib.ExitStack() as stack:
        bases = []
        for name, port, mine, other in (("a", port_a, bus_a, bus_b), ("b", port_b, bus_b, bus_a)):
            cfg = tmp_path / f"router-{name}.yaml"
            cfg.write_text(yaml.safe_dump({
                "port": port, "pods": pods, "booking_bus_bind": f"tcp://127.0.0.1:{mine}",
                "booking_bus_peers": [f"tcp://127.0.0.1:{other}"], "booking_bus_snapshot_s": 0.2, **settings}))
            stack.enter_context(kvroute_process(["serve", "--config", str(cfg)],
                                                ready_url=f"http://127.0.0.1:{port}/ready", timeout=40))
            bases.append(f"http://127.0.0.1:{port}")
        async with httpx.AsyncClient(timeout=30) as c:
            async def peers(base: str) -> bool:
                return "kvroute_booking_peers 1.0" in (await c.get(base + "/metrics")).text
            for _ in range(100):
                if await peers(bases[0]) and await peers(bases[1]):
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("the replicas never heard each other")
        yield bases[0], bases[1]


async def test_two_replicas_with_bind_and_peers_see_each_others_bookings(tmp_path):
    """Router replicas (two `kvroute serve` processes) configured with booking_bus_bind and
    booking_bus_peers: a burst sent through A is booked in B."""
    burst = 8
    # 2,000-token prompts at 1,000 tokens/s: no first token (which releases a booking) before 2 s,
    # so the scrapes at 1 s find the whole burst booked with a second to spare either side (at
    # 2,000 tokens/s the first release was due at the scrapes' moment, and a CI run saw A release
    # two between its scrape and B's)
    with running_sims(2, ["--timing", "seed", "--prefill-tokens-per-s", "1000"]) as urls:
        pods = [{"id": f"sim-{i}", "url": u, "model": "sim-model"} for i, u in enumerate(urls)]
        async with two_replicas(tmp_path, pods, prefill_tokens_per_s=1000.0, calibrate=False) as (a, b), \
                httpx.AsyncClient(timeout=120) as c:
            sends = [asyncio.create_task(c.post(a + "/v1/completions", json={
                "model": "sim-model", "prompt": [11 * k + j for j in range(2000)], "max_tokens": 1, "stream": True}))
                for k in range(burst)]
            await asyncio.sleep(1.0)
            _, booked_at_b = scrape((await c.get(b + "/metrics")).text)
            _, booked_at_a = scrape((await c.get(a + "/metrics")).text)
            assert all(r.status_code == 200 for r in await asyncio.gather(*sends))
            await asyncio.sleep(0.5)
            _, after = scrape((await c.get(b + "/metrics")).text)
    assert booked_at_b >= burst - 2 and abs(booked_at_b - booked_at_a) <= 1, (booked_at_a, booked_at_b)
    assert after == 0  # the releases reached B too


async def test_two_replicas_grant_a_keys_rate_limits_once_between_them(tmp_path):
    """A key's buckets were each process's own, so two replicas granted it twice its limits. Each
    replica now sends what it charged a key over the booking bus and charges its own buckets the
    same: requests that used up the key's burst on A are refused on B, and a prompt that put the
    key's prompt-token bucket in debt on A has B refuse it too."""
    keys = [{"key": "sk-few-requests", "name": "few-requests", "requests_per_s": 0.1, "request_burst": 3},
            {"key": "sk-few-tokens", "name": "few-tokens", "prompt_tokens_per_s": 10, "prompt_token_burst": 500}]
    with running_sims(1, ["--timing", "seed"]) as urls:
        pods = [{"id": "sim-0", "url": urls[0], "model": "sim-model"}]
        async with two_replicas(tmp_path, pods, api_keys=keys, public_metrics=True) as (a, b), \
                httpx.AsyncClient(timeout=30) as c:
            def send(base: str, key: str, prompt: list[int] | None = None):
                return c.post(base + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                              json={"model": "sim-model", "prompt": prompt or [1, 2, 3], "max_tokens": 1})
            codes = [(await send(a, "sk-few-requests")).status_code for _ in range(3)]
            assert codes == [200, 200, 200]
            await asyncio.sleep(0.3)  # the bus carries A's charges within milliseconds
            refused = await send(b, "sk-few-requests")
            assert refused.status_code == 429, refused.text
            assert "few-requests" in refused.json()["error"]["message"]
            assert (await send(a, "sk-few-requests")).status_code == 429

            assert (await send(a, "sk-few-tokens", list(range(1, 2001)))).status_code == 200  # 1,500 in debt
            await asyncio.sleep(0.3)
            assert (await send(b, "sk-few-tokens")).status_code == 429
            received = re.search(r'kvroute_booking_bus_messages_total\{direction="received",kind="limits"\} (\S+)',
                                 (await c.get(b + "/metrics")).text)
            assert received and float(received.group(1)) >= 2


async def test_two_replicas_take_back_a_credit_when_the_pod_refuses_the_request(tmp_path):
    """A request routed through A that the pod refuses (vLLM's 400 for a negative token id) had its
    prompt's blocks credited to the pod on A and, over the bus, on B. A withdraws its credit and B
    follows (``w`` messages, wired by ``Services``): a follow-up sharing the refused prompt's head is
    given none of it on B either. Without it B kept the credit for ``approximate_ttl_s`` (120 s: the
    pod publishes no KV events) and drew the follow-up to a pod that holds none of it. A served
    request's credit reaches B and stays, so the check is not empty."""
    bs = 16
    head = list(range(1, 1 + 8 * bs))
    refused_prompt = list(range(900, 900 + 8 * bs)) + [-1]
    with running_sims(2, ["--timing", "seed", "--block-size", str(bs)]) as urls:
        pods = [{"id": f"sim-{i}", "url": u, "model": "sim-model"} for i, u in enumerate(urls)]
        async with two_replicas(tmp_path, pods, block_size=bs) as (a, b), httpx.AsyncClient(timeout=30) as c:
            async def cached_on_b(prompt: list[int]) -> int:
                rows = (await c.post(b + "/debug/route", json={"model": "sim-model", "prompt": prompt,
                                                                "max_tokens": 1})).json()["pods"]
                return max(row["cached_tokens"] for row in rows)

            served = await c.post(a + "/v1/completions", json={"model": "sim-model", "prompt": head, "max_tokens": 1})
            assert served.status_code == 200, served.text
            await until_async(lambda: cached_on_b(head + [5]), 8 * bs, "A's credit of the served prompt on B")
            refused = await c.post(a + "/v1/completions",
                                   json={"model": "sim-model", "prompt": refused_prompt, "max_tokens": 1})
            assert refused.status_code == 400, refused.text
            await until_async(lambda: cached_on_b(refused_prompt[:-1] + [5]), 0, "the withdrawal on B")
            await asyncio.sleep(0.3)  # nothing brings it back
            assert await cached_on_b(refused_prompt[:-1] + [5]) == 0
            assert await cached_on_b(head + [5]) == 8 * bs
            text = (await c.get(b + "/metrics")).text
            received = re.search(r'kvroute_booking_bus_messages_total\{direction="received",kind="withdrawals"\} (\S+)',
                                 text)
            assert received and float(received.group(1)) >= 1, text[:2000]


async def until_async(read, want, what: str, timeout: float = 10.0) -> None:
    """Poll the coroutine function ``read`` until it returns ``want`` (at most ``timeout`` seconds)."""
    got = None
    for _ in range(int(timeout / 0.05)):
        got = await read()
        if got == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: {got!r}, not {want!r}")


def test_counts_from_tokenize_threads_and_the_loop_are_not_lost():
    """A tokenize thread counts the chunks it drops (``share_tokens``) while the loop counts others
    under the same key: every increment lands (without the lock about half were lost here)."""
    stats = BusStats()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        def bump() -> None:
            for _ in range(50_000):
                stats.count("tokens", "dropped")

        threads = [threading.Thread(target=bump) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads)
    assert stats.get("tokens", "dropped") == 200_000
