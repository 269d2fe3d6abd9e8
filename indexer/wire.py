"""Encoding KV events exactly as vLLM does, for test publishers and benchmarks.

These structs follow vLLM's msgspec declarations field for field (``EventBatch`` is
``array_like``; events are ``tag=True, omit_defaults=True`` maps since vLLM 0.24, tagged arrays
before), so ``encode_batch`` produces the bytes a real engine puts on the wire.
"""

from __future__ import annotations

from typing import Any

import msgspec

from indexer.events import encode_seq


class _MapEvent(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True):
    pass


class VBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class VBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class VAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True):
    pass


class VBlockStoredArray(_ArrEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None


class VBlockRemovedArray(_ArrEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class VAllBlocksClearedArray(_ArrEvent, tag="AllBlocksCleared"):
    pass


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def stored(hashes: list[Any], parent: Any, token_ids: list[int], block_size: int, medium: str | None = "GPU",
           lora_name: str | None = None, array: bool = False, **extra: Any) -> Any:
    """A BlockStored in the map form (or the legacy array form with ``array=True``)."""
    if array:
        return VBlockStoredArray(hashes, parent, token_ids, block_size, None, medium, lora_name)
    return VBlockStored(hashes, parent, token_ids, block_size, None, medium, lora_name, **extra)


def removed(hashes: list[Any], medium: str | None = "GPU", array: bool = False) -> Any:
    return VBlockRemovedArray(hashes, medium) if array else VBlockRemoved(hashes, medium)


def cleared(array: bool = False) -> Any:
    return VAllBlocksClearedArray() if array else VAllBlocksCleared()


def encode_batch(events: list[Any], ts: float = 0.0, dp_rank: int | None = 0) -> bytes:
    """The msgpack payload of one batch, ``[ts, events, data_parallel_rank]``."""
    return _encoder.encode(VEventBatch(ts, events, dp_rank))


def frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The live PUB message: ``[topic, seq (8 bytes big-endian), payload]``."""
    return [topic.encode("utf-8"), encode_seq(seq), payload]
