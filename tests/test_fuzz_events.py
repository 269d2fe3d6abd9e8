"""The KV-event decoder and subscriber against random and mutated msgpack frames: every bad frame
is refused with DecodeError (never another exception), what does decode applies to the index
without raising, and a live subscriber counts bad frames, drops them and keeps going."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer import wire
from indexer.events import DecodeError, decode_frame
from indexer.index import PrefixIndex
from indexer.subscriber import KVEventSubscriber
from tests.helpers import free_port

TOKS = list(range(32))
VALID = [
    wire.encode_batch([wire.stored([11, 12], None, TOKS, 16), wire.removed([11]), wire.cleared()], ts=1.5),
    wire.encode_batch([wire.stored([2**64 - 1], 5, TOKS[:16], 16)], ts=2.0, dp_rank=1),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1, 2], None, TOKS, 16, None, "CPU", None]], 0]),
]

# msgpack values that look like batches: nested lists/maps of the types a batch contains
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70).filter(lambda i: -(2**63) <= i < 2**64),
                    st.floats(allow_nan=True), st.text(max_size=12), st.binary(max_size=12),
                    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU"]))
_value = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.sampled_from(
                                                           ["type", "block_hashes", "parent_block_hash", "token_ids",
                                                            "block_size", "medium", "lora_id", "lora_name",
                                                            "extra_keys", "x"]), inner, max_size=6)), max_leaves=30)


def _apply_all(frames: list[bytes]) -> None:
    """Decode; if it decodes, the index must take every event without raising."""
    try:
        _, _, batch = decode_frame(frames)
    except DecodeError:
        return
    index = PrefixIndex(block_size=16)
    index.add_pod("p", "m")
    for ev in batch.events:
        index.apply_event("p", ev)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_frames_are_refused_with_decode_error_only(frames):
    _apply_all(frames)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_value, st.integers(0, 2**64 - 1))
def test_random_msgpack_payloads_decode_or_are_refused(value, seq):
    _apply_all([b"kv@p@m", seq.to_bytes(8, "big"), msgspec.msgpack.encode(value)])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID),
       st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "dup"]), st.integers(0, 10**6),
                          st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_valid_frames_decode_or_are_refused(payload, mutations):
    data = bytearray(payload)
    for kind, pos, byte in mutations:
        if not data:
            break
        i = pos % len(data)
        if kind == "flip":
            data[i] ^= byte or 1
        elif kind == "cut":
            del data[i:]
        elif kind == "insert":
            data.insert(i, byte)
        else:
            data[i:i] = data[i:i + 8]
    _apply_all([b"kv@p@m", (7).to_bytes(8, "big"), bytes(data)])


async def test_live_subscriber_counts_and_drops_bad_frames_and_keeps_applying_good_ones():
    port = free_port()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex(block_size=16)
    index.add_pod("p", "m")
    sub = KVEventSubscriber(index)
    sub.add_endpoint("p", f"tcp://127.0.0.1:{port}")
    await sub.start()
    try:
        garbage = [[b"kv@p@m"], [b"kv@p@m", b"\x00" * 8, b"\xc1\xc1"], [b"kv@p@m", b"\x01", VALID[0]],
                   [b"kv@p@m", (0).to_bytes(8, "big"), b"\x93\xcb"], [b"kv@p@m", (0).to_bytes(8, "big"), b"\xff" * 40]]
        good = wire.encode_batch([wire.stored([101, 102], None, TOKS, 16)], ts=time.time())
        deadline = time.monotonic() + 10
        stats = {}
        while time.monotonic() < deadline:  # PUB drops until the subscription lands: resend
            for frames in garbage:
                await pub.send_multipart(frames)
            await pub.send_multipart(wire.frames("kv@p@m", 0, good))
            await asyncio.sleep(0.1)
            stats = next(iter(sub.stats().values()))
            if stats["decode_errors"] >= len(garbage) and stats["batches"] >= 1:
                break
        assert stats["decode_errors"] >= len(garbage), stats
        assert stats["batches"] >= 1, stats
        assert index.pod_stats("p")["blocks"] >= 2 or index.stats()["keys"] >= 2
    finally:
        await sub.stop()
        pub.close(0)
        ctx.term()
