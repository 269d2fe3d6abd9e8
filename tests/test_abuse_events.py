"""A hostile or hijacked KV-event endpoint (issue 13): oversized frames, replay answers that never
end, and CURVE so only the holder of the publishers' secret key can feed the index."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from indexer import wire
from indexer.events import encode_seq
from indexer.index import PrefixIndex
from indexer.subscriber import CurveKeys, KVEventSubscriber, SocketBounds, request_replay
from tests.helpers import free_ports
from tests.test_subscriber import BS, MODEL, blocks, toks


def _sub(ctx, port, **kw):
    ix = PrefixIndex(block_size=BS)
    sub = KVEventSubscriber(ix, context=ctx, reconnect_min_s=0.05, reconnect_max_s=0.2, catch_up_on_connect=False, **kw)
    sub.add_endpoint("pod-a", f"tcp://127.0.0.1:{port}", None, topic="", model=MODEL)
    return ix, sub


async def _publish_until(pub, ix, tokens, seq0, timeout=5.0) -> bool:
    deadline, seq = time.monotonic() + timeout, seq0
    while time.monotonic() < deadline:
        await pub.send_multipart(wire.frames("kv", seq, wire.encode_batch([wire.stored([seq + 1], None, tokens, BS)],
                                                                       ts=time.time())))
        seq += 1
        await asyncio.sleep(0.05)
        if blocks(ix, tokens):
            return True
    return False


async def test_an_oversized_frame_is_refused_and_the_stream_goes_on():
    ctx = zmq.asyncio.Context()
    (port,) = free_ports(1)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    ix, sub = _sub(ctx, port, max_frame_bytes=1024 * 1024)
    await sub.start()
    try:
        assert await _publish_until(pub, ix, toks(1, base=100), 0)
        # a 20 MB frame: libzmq drops the connection instead of buffering it
        big = [wire.stored([10_000 + i], None, toks(1, base=200 + i), BS) for i in range(1)]
        payload = wire.encode_batch(big, ts=time.time()) + b"\x00" * (20 * 1024 * 1024)
        for _ in range(3):
            await pub.send_multipart([b"kv", encode_seq(1_000), payload])
        await asyncio.sleep(0.3)
        assert not blocks(ix, toks(1, base=200))
        assert await _publish_until(pub, ix, toks(1, base=300), 2_000)  # reconnected and following again
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_a_replay_answer_without_an_end_marker_is_bounded():
    ctx = zmq.asyncio.Context()
    (port,) = free_ports(1)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    payload = wire.encode_batch([wire.stored([1], None, toks(1), BS)], ts=time.time())

    async def endless():
        ident, _, _ = await router.recv_multipart()
        seq = 0
        while True:  # never the end marker; replies as fast as it can
            await router.send_multipart([ident, b"", b"kv", encode_seq(seq), payload])
            seq += 1
            await asyncio.sleep(0)

    server = asyncio.ensure_future(endless())
    try:
        started = time.monotonic()
        got = await request_replay(ctx, f"tcp://127.0.0.1:{port}", 0, 5.0,
                                   bounds=SocketBounds(max_replay_batches=500, max_replay_bytes=10**9))
        assert got is None and time.monotonic() - started < 3
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        router.close(linger=0)
        ctx.destroy(linger=0)


async def test_curve_lets_only_the_key_holder_publish():
    assert zmq.has("curve")
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    ctx = zmq.asyncio.Context()
    good_port, rogue_port = free_ports(2)
    good = ctx.socket(zmq.PUB)
    good.setsockopt(zmq.LINGER, 0)
    good.curve_server = True
    good.curve_secretkey = server_secret
    good.curve_publickey = server_public
    good.bind(f"tcp://127.0.0.1:{good_port}")
    rogue = ctx.socket(zmq.PUB)  # a hijacked endpoint without the server's secret key
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(f"tcp://127.0.0.1:{rogue_port}")
    keys = CurveKeys(server_public.decode(), client_public.decode(), client_secret.decode())
    ix_good, sub_good = _sub(ctx, good_port, curve=keys)
    ix_rogue, sub_rogue = _sub(ctx, rogue_port, curve=keys)
    await sub_good.start()
    await sub_rogue.start()
    try:
        assert await _publish_until(good, ix_good, toks(1, base=500), 0)
        assert not await _publish_until(rogue, ix_rogue, toks(1, base=600), 0, timeout=1.5)
    finally:
        await sub_good.stop()
        await sub_rogue.stop()
        good.close(linger=0)
        rogue.close(linger=0)
        ctx.destroy(linger=0)
