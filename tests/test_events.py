"""Wire decoding of vLLM KV-event batches: every shape seen on the wire, and bad input."""

from __future__ import annotations

import msgspec
import pytest

from indexer import wire
from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_frame,
    decode_payload,
    decode_seq,
    event_to_dict,
    normalize_hash,
)

TOKS = list(range(32))
enc = msgspec.msgpack.encode


def test_map_form_batch_as_vllm_publishes_it():
    payload = wire.encode_batch([wire.stored([11, 12], None, TOKS, 16), wire.removed([11]), wire.cleared()],
                                ts=1.5, dp_rank=2)
    topic, seq, batch = decode_frame(wire.frames("kv@pod-a@m", 41, payload))
    assert (topic, seq, batch.ts, batch.dp_rank) == ("kv@pod-a@m", 41, 1.5, 2)
    stored, rem, clr = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [11, 12] and stored.token_ids == TOKS
    assert stored.block_size == 16 and stored.medium == "GPU" and stored.parent_block_hash is None
    assert isinstance(rem, BlockRemoved) and rem.block_hashes == [11] and rem.medium == "GPU"
    assert isinstance(clr, AllBlocksCleared)


def test_legacy_array_events_and_two_element_batch():
    ev = ["BlockStored", [1, 2], 7, TOKS, 16, None, "CPU", "adapter-x"]
    batch = decode_payload(enc([2.0, [ev, ["BlockRemoved", [2], "CPU"], ["AllBlocksCleared"]]]))
    assert batch.dp_rank is None and batch.ts == 2.0
    s, r, c = batch.events
    assert (s.block_hashes, s.parent_block_hash, s.medium, s.lora_name) == ([1, 2], 7, "CPU", "adapter-x")
    assert r.block_hashes == [2] and r.medium == "CPU" and isinstance(c, AllBlocksCleared)


def test_oldest_array_form_without_medium_or_lora_name():
    batch = decode_payload(enc([1.0, [["BlockStored", [5], None, list(range(16)), 16, None]], 0]))
    assert batch.events[0].medium is None and batch.events[0].lora_name is None


def test_map_batch_is_accepted():
    ev = {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": list(range(16)),
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    batch = decode_payload(enc({"ts": 3.0, "events": [ev], "data_parallel_rank": 1}))
    assert batch.dp_rank == 1 and batch.events[0].block_hashes == [3]


def test_hash_normalisation_signed_unsigned_bytes():
    assert normalize_hash(-1) == 2**64 - 1
    assert normalize_hash(2**64 - 1) == 2**64 - 1
    digest = bytes(range(32))
    assert normalize_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert normalize_hash(b"\x01\x02") == 0x0102  # left-padded
    batch = decode_payload(wire.encode_batch([wire.stored([-5, digest], -7, TOKS, 16)]))
    ev = batch.events[0]
    assert ev.block_hashes == [2**64 - 5, int.from_bytes(digest[-8:], "big")]
    assert ev.parent_block_hash == 2**64 - 7


def test_all_bytes_hashes_vllm_use_int_hashes_off():
    d1, d2 = b"\xaa" * 32, b"\xbb" * 16
    batch = decode_payload(wire.encode_batch([wire.stored([d1, d2], None, TOKS, 16), wire.removed([d1])]))
    assert batch.events[0].block_hashes == [int.from_bytes(d1[-8:], "big"), int.from_bytes(d2[-8:], "big")]
    assert batch.events[1].block_hashes == [int.from_bytes(d1[-8:], "big")]


def test_unknown_fields_and_unknown_event_types_are_ignored():
    evs = [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16)),
            "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "session_id": "s",
            "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention", "locality": None},
           {"type": "SomethingNew", "x": 1},
           ["FutureArrayEvent", 1, 2]]
    batch = decode_payload(enc([1.0, evs, 0]))
    assert len(batch.events) == 1 and batch.events[0].kv_cache_spec_kind == "full_attention"
    assert batch.events[0].extra_keys == [None] and batch.events[0].group_idx == 0


def test_extra_array_fields_are_ignored():
    ev = ["BlockStored", [1], None, list(range(16)), 16, None, "GPU", None, [None], 0, "full_attention", None,
          "LOCAL", "x", "session-1", "a field of a later vLLM"]
    got = decode_payload(enc([1.0, [ev], 0])).events[0]
    assert (got.group_idx, got.locality, got.ownership, got.session_id) == (0, "LOCAL", "x", "session-1")


def test_vllm_032_store_and_remove_fields_are_decoded_in_both_forms():
    # vLLM 0.32's BlockStored: ... group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality,
    # ownership, session_id; BlockRemoved: block_hashes, medium, group_idx, locality, ownership
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16)),
              "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None, "extra_keys": [None],
              "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4096,
              "locality": "REMOTE", "ownership": "kvcr", "session_id": "s-9"}
    removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "group_idx": 1, "locality": "REMOTE",
               "ownership": "kvcr"}
    for batch in (decode_payload(enc([1.0, [stored, removed], 0])),                      # the typed path
                  decode_payload(enc([1.0, [stored, removed, {"type": "New"}], 0]))):  # the tolerant path
        s, r = batch.events
        assert (s.kv_cache_spec_sliding_window, s.locality, s.ownership, s.session_id) == (4096, "REMOTE", "kvcr",
                                                                                           "s-9")
        assert (r.group_idx, r.locality, r.ownership) == (1, "REMOTE", "kvcr")


@pytest.mark.parametrize("payload", [
    b"\xc1", b"", enc("hello"), enc([1.0]), enc(["ts", [], 0]), enc([1.0, "events", 0]), enc([1.0, [], "rank"]),
    enc([1.0, [{"type": "BlockStored", "block_hashes": "nope"}], 0]),
    enc([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}], 0]),
    enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"]}], 0]),
    enc([1.0, [42], 0]),
    # nested past msgspec's recursion limit, whole or inside a field (it raised RecursionError, which
    # made the subscriber rebuild its socket and lose the good batches queued behind it)
    b"\x91" * 2000 + b"\xc0",
    enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16)),
                "block_size": 16, "extra_keys": "DEEP"}], 0]).replace(enc("DEEP"), b"\x91" * 2000 + b"\xc0"),
])
def test_malformed_payloads_raise_decode_error(payload):
    with pytest.raises(DecodeError):
        decode_payload(payload)


def test_malformed_frames():
    with pytest.raises(DecodeError):
        decode_frame([b"topic", b"\x00" * 8])
    with pytest.raises(DecodeError):
        decode_frame([b"t", b"", wire.encode_batch([])])
    with pytest.raises(DecodeError):
        decode_frame([b"t", b"\x00" * 9, wire.encode_batch([])])
    assert decode_seq(b"\xff" * 8) == 2**64 - 1


def test_event_to_dict_has_type_and_all_fields():
    d = event_to_dict(BlockRemoved(block_hashes=[1], medium="CPU"))
    assert d == {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "group_idx": None, "locality": None,
                 "ownership": None}
