"""The subscriber over real ZeroMQ against a publisher that sends vLLM's exact frames."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq
import zmq.asyncio

from indexer import wire
from indexer.events import encode_seq
from indexer.index import PrefixIndex
from indexer.keys import prompt_keys
from indexer.subscriber import KVEventSubscriber
from tests.helpers import free_ports

BS = 4
MODEL = "m"
END = [b"", b"", b"\xff" * 8, b""]


def _bind(sock, port):
    """Bind, retrying briefly: a just-closed socket may hold the port for a moment."""
    deadline = time.monotonic() + 3
    while True:
        try:
            return sock.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class Publisher:
    """PUB + ROUTER replay like vLLM's ZmqEventPublisher (>= 0.26 replay layout, or the old one)."""

    def __init__(self, ctx, pub_port, replay_port, topic="kv@pod-a@m", old_layout=False, buffer_steps=10_000):
        self.ctx, self.pub_port, self.replay_port = ctx, pub_port, replay_port
        self.topic, self.old_layout, self.buffer_steps = topic, old_layout, buffer_steps
        self.answer_replays = True
        self._start()

    def _start(self):
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        _bind(self.pub, self.pub_port)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        _bind(self.router, self.replay_port)
        self.task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _serve_replay(self):
        while True:
            ident, empty, start = await self.router.recv_multipart()
            if not self.answer_replays:
                continue
            start = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    body = ([encode_seq(seq), payload] if self.old_layout
                            else [self.topic.encode(), encode_seq(seq), payload])
                    await self.router.send_multipart([ident, b"", *body])
            await self.router.send_multipart([ident, *(END[:1] + END[2:] if self.old_layout else END)])

    async def publish(self, events, drop=False, dp_rank=0):
        payload = wire.encode_batch(events, ts=time.time(), dp_rank=dp_rank)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        del self.buffer[:-self.buffer_steps]
        if not drop:
            await self.pub.send_multipart(wire.frames(self.topic, seq, payload))
        return seq

    async def stop(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)

    async def restart(self):
        await self.stop()
        await asyncio.sleep(0.05)
        self._start()


def toks(n, base=0):
    return [base + i for i in range(n * BS)]


async def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def setup(old_layout=False, catch_up=True, replay=True, **sub_kw):
    ctx = zmq.asyncio.Context()
    pub_port, rep_port = free_ports(2)
    pub = Publisher(ctx, pub_port, rep_port, old_layout=old_layout)
    ix = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(ix, context=ctx, replay_timeout_s=1.0, reconnect_min_s=0.05, reconnect_max_s=0.2,
                            catch_up_on_connect=catch_up, **sub_kw)
    sub.add_endpoint("pod-a", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}" if replay else None,
                     topic="kv@", model=MODEL)
    await sub.start()
    return ctx, pub, ix, sub


async def teardown(ctx, pub, sub):
    await sub.stop()
    await pub.stop()
    ctx.destroy(linger=0)


def stats(sub):
    return next(iter(sub.stats().values()))


async def connected(pub, sub, ix):
    """Publish a marker block until the subscriber has applied it (PUB drops before the SUB joins)."""
    i = 0
    deadline = time.monotonic() + 5
    while stats(sub)["batches"] == 0:
        await pub.publish([wire.stored([900_000 + i], None, toks(1, base=9000 + i), BS)])
        i += 1
        await asyncio.sleep(0.02)
        assert time.monotonic() < deadline


def blocks(ix, tokens):
    return ix.match(prompt_keys(tokens, BS, MODEL)).get("pod-a").blocks


async def test_live_events_reach_the_index():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        t = toks(4)
        await pub.publish([wire.stored([1, 2], None, t[:8], BS)])
        await pub.publish([wire.stored([3, 4], 2, t[8:], BS), wire.removed([4])])
        await until(lambda: blocks(ix, t) == 3)
        s = stats(sub)
        assert s["gaps"] == 0 and s["decode_errors"] == 0 and s["last_seq"] == pub.seq - 1
        assert s["last_event_age_s"] is not None and s["lag_s"] is not None and s["lag_s"] < 5
    finally:
        await teardown(ctx, pub, sub)


async def test_one_engine_of_a_data_parallel_pod_is_its_pods_only_source_whatever_its_global_rank():
    """The router routes each engine of a data-parallel pod as a pod (``<pod>#<r>``); its batches carry
    the engine's global rank, which on a large multi-node deployment is past the index's per-pod rank
    bound, so such a stream is indexed as its pod's rank 0."""
    ctx = zmq.asyncio.Context()
    pub_port, rep_port = free_ports(2)
    pub = Publisher(ctx, pub_port, rep_port)
    ix = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(ix, context=ctx, replay_timeout_s=1.0, reconnect_min_s=0.05, reconnect_max_s=0.2)
    sub.add_endpoint("pod-a#3", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}", topic="kv@",
                     model=MODEL, one_rank=True)
    await sub.start()
    try:
        t = toks(2)
        deadline = time.monotonic() + 5
        while ix.match(prompt_keys(t, BS, MODEL)).get("pod-a#3").blocks < 2:
            await pub.publish([wire.stored([1, 2], None, t, BS)], dp_rank=131)
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, "the engine's blocks never reached the index"
        assert ix.pod_stats("pod-a#3")["dp_ranks"] == [0]
        assert ix.counters["refused_events"] == 0
    finally:
        await teardown(ctx, pub, sub)


async def test_dropped_batches_are_repaired_by_replay():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        r0 = stats(sub)["replayed_batches"]
        t = toks(4)
        await pub.publish([wire.stored([1, 2], None, t[:8], BS)])
        await pub.publish([wire.stored([3, 4], 2, t[8:], BS)], drop=True)
        await pub.publish([wire.removed([1])], drop=True)
        await pub.publish([wire.stored([1], None, t[:4], BS)])
        await until(lambda: stats(sub)["last_seq"] == pub.seq - 1)
        assert blocks(ix, t) == 4
        s = stats(sub)
        assert s["gaps"] == 1 and s["replays"] >= 1 and s["replayed_batches"] - r0 == 2 and s["lost_batches"] == 0
    finally:
        await teardown(ctx, pub, sub)


async def test_old_replay_layout_also_repairs():
    ctx, pub, ix, sub = await setup(old_layout=True)
    try:
        await connected(pub, sub, ix)
        r0 = stats(sub)["replayed_batches"]
        t = toks(2)
        await pub.publish([wire.stored([1], None, t[:4], BS)], drop=True)
        await pub.publish([wire.stored([2], 1, t[4:], BS)])
        await until(lambda: blocks(ix, t) == 2)
        assert stats(sub)["replayed_batches"] - r0 == 1
    finally:
        await teardown(ctx, pub, sub)


async def test_catch_up_from_the_replay_buffer_on_connect():
    ctx = zmq.asyncio.Context()
    pub_port, rep_port = free_ports(2)
    pub = Publisher(ctx, pub_port, rep_port)
    t = toks(3)
    await pub.publish([wire.stored([1, 2, 3], None, t, BS)])  # before anyone listens
    ix = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(ix, context=ctx, replay_timeout_s=1.0)
    sub.add_endpoint("pod-a", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}", model=MODEL)
    await sub.start()
    try:
        await connected(pub, sub, ix)
        assert blocks(ix, t) == 3
    finally:
        await teardown(ctx, pub, sub)


async def test_catch_up_on_connect_does_not_wait_for_an_idle_pod_to_publish():
    # a router restarted beside an idle pod: the pod publishes nothing more, yet what its replay
    # buffer holds must reach the index
    ctx = zmq.asyncio.Context()
    pub_port, rep_port = free_ports(2)
    pub = Publisher(ctx, pub_port, rep_port)
    t = toks(3)
    await pub.publish([wire.stored([1, 2, 3], None, t, BS)])
    await pub.publish([wire.stored([4], 3, toks(1, base=400), BS)])
    ix = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(ix, context=ctx, replay_timeout_s=1.0)
    sub.add_endpoint("pod-a", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}", model=MODEL)
    await sub.start()
    try:
        await until(lambda: blocks(ix, t) == 3)
        s = stats(sub)
        assert s["last_seq"] == 1 and s["replayed_batches"] == 2 and s["lost_batches"] == 0, s
        # the next live batch follows on from the replay, without another one
        t2 = toks(1, base=800)
        deadline = time.monotonic() + 5
        while blocks(ix, t2) != 1:  # PUB drops until the subscription lands: resend
            await pub.publish([wire.stored([80], None, t2, BS)])
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, stats(sub)
        assert stats(sub)["restarts"] == 0 and blocks(ix, t) == 3
    finally:
        await teardown(ctx, pub, sub)


async def test_engine_restart_right_after_the_catch_up_is_told_apart_from_a_duplicate():
    ctx = zmq.asyncio.Context()
    pub_port, rep_port = free_ports(2)
    pub = Publisher(ctx, pub_port, rep_port)
    old = toks(2)
    for i in range(4):
        await pub.publish([wire.stored([10 + i], None, toks(1, base=500 + 10 * i), BS)])
    await pub.publish([wire.stored([1, 2], None, old, BS)])
    ix = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(ix, context=ctx, replay_timeout_s=1.0, reconnect_min_s=0.05)
    sub.add_endpoint("pod-a", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}", model=MODEL)
    await sub.start()
    try:
        await until(lambda: blocks(ix, old) == 2)
        await pub.restart()  # a new engine: its sequence numbers are below what the catch-up applied
        new = toks(2, base=100)
        deadline = time.monotonic() + 10
        while blocks(ix, new) != 2:
            await pub.publish([wire.stored([7, 8], None, new, BS)])
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, stats(sub)
        s = stats(sub)
        # recognised at its first live batch, not dropped as already applied
        assert blocks(ix, old) == 0 and s["restarts"] == 1 and s["duplicates"] == 0, s
    finally:
        await teardown(ctx, pub, sub)


async def test_engine_restart_clears_old_entries_and_the_subscriber_recovers():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        old = toks(3)
        for i in range(5):
            await pub.publish([wire.stored([10 + i], None, toks(1, base=500 + 10 * i), BS)])
        await pub.publish([wire.stored([1, 2, 3], None, old, BS)])
        await until(lambda: blocks(ix, old) == 3)
        await pub.restart()  # killed and started again: same ports, seq from 0, empty cache
        new = toks(2, base=100)
        deadline = time.monotonic() + 10
        while stats(sub)["restarts"] == 0 or blocks(ix, new) != 2:
            await pub.publish([wire.stored([7, 8], None, new, BS)])
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, stats(sub)
        assert blocks(ix, old) == 0
        assert stats(sub)["restarts"] >= 1
    finally:
        await teardown(ctx, pub, sub)


async def test_restart_hidden_behind_a_forward_jump_is_detected_by_replay():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        old = toks(2)
        await pub.publish([wire.stored([1, 2], None, old, BS)])
        await until(lambda: blocks(ix, old) == 2)
        last = stats(sub)["last_seq"]
        await pub.stop()
        pub._start()
        # the new engine gets further than our old position before we hear from it
        for i in range(last + 3):
            await pub.publish([wire.stored([50 + i], None, toks(1, base=3000 + 10 * i), BS)], drop=True)
        new = toks(2, base=100)
        deadline = time.monotonic() + 10
        while blocks(ix, new) != 2:
            await pub.publish([wire.stored([7, 8], None, new, BS)])
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, stats(sub)
        assert blocks(ix, old) == 0 and stats(sub)["restarts"] == 1
        assert blocks(ix, toks(1, base=3000)) == 1  # the new engine's early batches came by replay
    finally:
        await teardown(ctx, pub, sub)


async def test_idle_restarted_engine_is_cleared_on_reconnect_without_a_live_batch():
    """An engine that restarts and then publishes nothing (idle, or its first batch lost before the
    subscription reached it) is found out when the SUB reconnects: its replay buffer does not hold
    our last batch, so the pod's entries go without waiting for traffic."""
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        old = toks(2)
        await pub.publish([wire.stored([1, 2], None, old, BS)])
        await until(lambda: blocks(ix, old) == 2)
        await pub.stop()
        pub._start()  # a new engine on the same ports, with an empty replay buffer, silent
        await until(lambda: blocks(ix, old) == 0, timeout=10)
        assert stats(sub)["restarts"] == 1
        new = toks(2, base=100)
        deadline = time.monotonic() + 10
        while blocks(ix, new) != 2:  # and its first batches are indexed from sequence 0 on
            await pub.publish([wire.stored([7, 8], None, new, BS)])
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, stats(sub)
        assert stats(sub)["restarts"] == 1
    finally:
        await teardown(ctx, pub, sub)


async def test_batch_lost_while_the_subscription_settles_after_a_restart_is_replayed():
    """After a reconnect, a batch the publisher sent before our subscription reached it never arrives
    live; a second look at the replay buffer a moment later applies it."""
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        old = toks(2)
        await pub.publish([wire.stored([1, 2], None, old, BS)])
        await until(lambda: blocks(ix, old) == 2)
        await pub.stop()
        pub._start()
        await until(lambda: blocks(ix, old) == 0, timeout=10)  # the reconnect check cleared the pod
        new = toks(2, base=100)
        await pub.publish([wire.stored([7, 8], None, new, BS)], drop=True)  # in the buffer, never live
        await until(lambda: blocks(ix, new) == 2, timeout=10)
    finally:
        await teardown(ctx, pub, sub)


async def test_restart_landing_exactly_on_the_next_sequence_is_detected():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        old = toks(2)
        await pub.publish([wire.stored([1, 2], None, old, BS)])
        await until(lambda: blocks(ix, old) == 2)
        last = stats(sub)["last_seq"]
        await pub.stop()
        pub._start()
        for i in range(last + 1):  # the new engine's next live batch will carry last + 1
            await pub.publish([wire.stored([50 + i], None, toks(1, base=3000 + 10 * i), BS)], drop=True)
        new = toks(2, base=100)
        deadline = time.monotonic() + 10
        while blocks(ix, new) != 2:
            await pub.publish([wire.stored([7, 8], None, new, BS)])
            await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, stats(sub)
        assert stats(sub)["disconnects"] >= 1 and stats(sub)["restarts"] == 1
        assert blocks(ix, old) == 0
    finally:
        await teardown(ctx, pub, sub)


async def test_unanswered_replay_times_out_and_counts_lost_batches():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        pub.answer_replays = False
        t = toks(2)
        await pub.publish([wire.stored([1], None, t[:4], BS)], drop=True)
        await pub.publish([wire.stored([5], None, toks(1, base=77), BS)])
        await until(lambda: stats(sub)["replay_failures"] == 1, timeout=5)
        await until(lambda: stats(sub)["last_seq"] == pub.seq - 1)
        assert stats(sub)["lost_batches"] == 1 and blocks(ix, toks(1, base=77)) == 1
    finally:
        await teardown(ctx, pub, sub)


async def test_malformed_frames_are_counted_and_dropped():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        await pub.pub.send_multipart([b"kv@x", b"\x00" * 8, b"\xc1garbage"])
        await pub.pub.send_multipart([b"kv@x", b"short"])
        await pub.pub.send_multipart([b"kv@x", encode_seq(10**6),
                                      msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0])])
        t = toks(1, base=40)
        await pub.publish([wire.stored([41], None, t, BS)])
        await until(lambda: blocks(ix, t) == 1)
        assert stats(sub)["decode_errors"] == 3
    finally:
        await teardown(ctx, pub, sub)


async def test_topic_filter():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        pub.topic = "other@pod"
        t = toks(1, base=60)
        await pub.publish([wire.stored([61], None, t, BS)])
        pub.topic = "kv@pod-a@m"
        t2 = toks(1, base=70)
        await pub.publish([wire.stored([71], None, t2, BS)])
        await until(lambda: blocks(ix, t2) == 1)
        # the filtered batch left a gap, repaired from the replay buffer, which is not filtered
        assert stats(sub)["gaps"] == 1
    finally:
        await teardown(ctx, pub, sub)


async def test_remove_pod_leaves_the_index_at_once():
    ctx, pub, ix, sub = await setup()
    try:
        await connected(pub, sub, ix)
        t = toks(2)
        await pub.publish([wire.stored([1, 2], None, t, BS)])
        await until(lambda: blocks(ix, t) == 2)
        sub.remove_pod("pod-a")
        assert "pod-a" not in ix.match(prompt_keys(t, BS, MODEL))
        assert sub.stats() == {}
        await pub.publish([wire.stored([3], None, toks(1, base=5), BS)])
        await asyncio.sleep(0.1)
        assert not ix.has_pod("pod-a")
    finally:
        await teardown(ctx, pub, sub)
