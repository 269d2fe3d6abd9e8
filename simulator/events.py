"""KV-cache events as vLLM encodes them, and vLLM's ``--kv-events-config``.

The structs mirror vLLM's msgspec declarations field for field, so msgspec produces the same bytes:

* the batch is always a positional array ``[ts, events, data_parallel_rank]``;
* events are type-tagged maps (``{"type": "BlockStored", ...}``, vLLM >= 0.24), or, with the legacy
  format, tagged arrays (``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx]``, vLLM <= 0.23).

Fields declared without a default are always on the wire (even as nil); defaulted ones are left out
of maps when equal to the default, as ``omit_defaults=True`` does in vLLM. Like vLLM 0.33 with one
full-attention KV-cache group, map events carry ``extra_keys`` (one nil per block), ``group_idx=0``
and ``kv_cache_spec_kind="full_attention"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

END_SEQ = b"\xff" * 8  # the replay end marker's sequence field (-1 as 8 signed big-endian bytes)


# --- fields vLLM <= 0.23 declared, in its positional order ------------------------------------------
# Both wire forms carry these first and in this order; the map form appends the fields later vLLM
# versions added. Keep this list as it is: the legacy array form's positions depend on it.
class _StoredFields(msgspec.Struct, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _RemovedFields(msgspec.Struct, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


# --- map form (vLLM >= 0.24: type-tagged maps) ---------------------------------------------------
class _MapEvent(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False):
    pass


class BlockStored(_StoredFields, _MapEvent):
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(_RemovedFields, _MapEvent):
    locality: str | None = None


class AllBlocksCleared(_MapEvent):
    pass


# --- legacy array form (vLLM <= 0.23: tagged arrays, every field positional) --------------------
class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class LegacyBlockStored(_StoredFields, _ArrayEvent, tag="BlockStored"):
    pass


class LegacyBlockRemoved(_RemovedFields, _ArrayEvent, tag="BlockRemoved"):
    pass


class LegacyAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


Event = (BlockStored | BlockRemoved | AllBlocksCleared
         | LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared)


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def block_stored(fmt: str, hashes: list[int], parent: int | None, token_ids: list[int],
                 block_size: int, medium: str = "GPU", extra_keys: list[Any] | None = None,
                 group_idx: int = 0, kind: str = "full_attention",
                 lora: tuple[int, str, str] | None = None) -> Event:
    """A BlockStored event in ``fmt`` ('map' or 'array') for one run of newly cached blocks;
    ``extra_keys`` one entry per block (a cache salt on the first block: ``[salt]``; an adapter's
    name on every block), ``lora`` the adapter (id, name, path) whose request stored them."""
    lora_id, lora_name = (lora[0], lora[1]) if lora is not None else (None, None)
    if fmt == "array":
        return LegacyBlockStored(hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
                                 group_idx)
    return BlockStored(hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
                       extra_keys=extra_keys or [None] * len(hashes), group_idx=group_idx,
                       kv_cache_spec_kind=kind)


def block_removed(fmt: str, hashes: list[int], medium: str = "GPU", group_idx: int = 0) -> Event:
    if fmt == "array":
        return LegacyBlockRemoved(hashes, medium, group_idx)
    return BlockRemoved(hashes, medium, group_idx=group_idx)


def all_blocks_cleared(fmt: str) -> Event:
    return LegacyAllBlocksCleared() if fmt == "array" else AllBlocksCleared()


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[Event], dp_rank: int = 0) -> bytes:
    """The payload frame of one batch, byte for byte what vLLM's publisher sends."""
    return _ENCODER.encode(KVEventBatch(ts, events, dp_rank))


# --- --kv-events-config ---------------------------------------------------------------------------
class KVEventsConfigError(ValueError):
    pass


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (same fields and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVEventsConfig:
        if not isinstance(data, dict):
            raise KVEventsConfigError("kv-events-config must be a JSON object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise KVEventsConfigError(f"unknown kv-events-config fields: {sorted(unknown)}")
        types = {"enable_kv_cache_events": bool, "endpoint": str, "buffer_steps": int, "hwm": int,
                 "max_queue_size": int, "topic": str}
        for key, typ in types.items():
            if key in data and not (isinstance(data[key], typ) and not (typ is int and isinstance(data[key], bool))):
                raise KVEventsConfigError(f"kv-events-config field {key!r} must be {typ.__name__}")
        if data.get("publisher") not in (None, "null", "zmq"):
            raise KVEventsConfigError("kv-events-config 'publisher' must be 'zmq' or 'null'")
        if data.get("replay_endpoint") is not None and not isinstance(data["replay_endpoint"], str):
            raise KVEventsConfigError("kv-events-config 'replay_endpoint' must be a string or null")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if key in data and data[key] < 0:
                raise KVEventsConfigError(f"kv-events-config {key!r} must be >= 0")
        return cls(**data)

    @classmethod
    def shortcut(cls, port: int, ranks: int = 1) -> KVEventsConfig:
        """What ``--kv-events-port E`` stands for (the topic is filled in per pod): events on E, replay
        on E+1; with ``ranks`` data-parallel engines, events on E..E+ranks-1 and replay from E+ranks."""
        return cls(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
                   replay_endpoint=f"tcp://*:{port + ranks}", topic="kv@{pod}@{model}")

    def for_pod(self, index: int, pod: str, model: str, ranks: int = 1) -> KVEventsConfig:
        """Pod ``index`` of a ``--count`` group: binding tcp ports + 2*ranks*index, topic placeholders filled."""
        return self._offset(2 * ranks * index, self.topic.replace("{pod}", pod).replace("{model}", model))

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Data-parallel rank ``rank`` of a pod: endpoint and replay ports + rank, as vLLM offsets them."""
        return self._offset(rank, self.topic)

    def _offset(self, by: int, topic: str) -> KVEventsConfig:
        return KVEventsConfig(
            enable_kv_cache_events=self.enable_kv_cache_events, publisher=self.publisher,
            endpoint=offset_endpoint(self.endpoint, by) if is_bind(self.endpoint) else self.endpoint,
            replay_endpoint=offset_endpoint(self.replay_endpoint, by) if self.replay_endpoint else None,
            buffer_steps=self.buffer_steps, hwm=self.hwm, max_queue_size=self.max_queue_size, topic=topic)


def is_bind(endpoint: str) -> bool:
    """vLLM binds when the endpoint has a wildcard or is ipc/inproc; otherwise it connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_TCP_PORT = re.compile(r"^(tcp://.*):(\d+)$")


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:P`` -> ``tcp://host:P+offset``; inproc/ipc get a ``_<offset>`` suffix (as vLLM's DP rule)."""
    if offset == 0:
        return endpoint
    m = _TCP_PORT.match(endpoint)
    if m:
        return f"{m.group(1)}:{int(m.group(2)) + offset}"
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_{offset}"
    raise KVEventsConfigError(f"cannot offset endpoint {endpoint!r}")
