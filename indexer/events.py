"""Decoding of vLLM's KV-cache event stream: ZMQ frames in, typed event batches out.

One ZMQ message per batch: ``[topic, seq (8 bytes big-endian), payload]``. The payload is msgpack
written by msgspec. What has been seen on the wire across vLLM releases, all accepted here:

* the batch: a positional array ``[ts, events, data_parallel_rank]``; before data-parallel ranks
  were added, ``[ts, events]``; defensively also a map ``{ts, events, data_parallel_rank}``;
* each event: a map tagged by ``"type"`` (vLLM >= 0.24) or a legacy array tagged by element 0
  (``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, ...]``);
* block hashes: unsigned 64-bit ints (current default), signed 64-bit ints (old builtin ``hash()``),
  or raw digest bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). All become uint64: ints are
  reinterpreted as two's complement, bytes give their last 8 bytes read big-endian (left-padded).

Unknown fields and unknown event types are ignored, so newer engines keep working. Anything that
cannot be read as a batch raises :class:`DecodeError`; callers count it and drop the frame.

Speed: the common case (map events, int hashes) is decoded by one typed msgspec decoder straight
into the public structs; legacy arrays take a second typed decoder; anything else falls back to a
generic decode and a tolerant hand conversion.
"""

from __future__ import annotations

from typing import Any

import msgspec

U64 = (1 << 64) - 1
END_SEQ = U64  # sequence value of the replay end marker (-1 as 8 bytes)


class DecodeError(ValueError):
    """A frame or payload that is not a KV-event batch. Count it and drop it; never fatal."""


# --- the fields of each event, in the legacy array form's positional order --------------------------
# Shared by the map-form types below and the array-form decoder targets, so both wire forms accept
# exactly the same fields; the order here is the array form's (and the map form's field order).
class _StoredFields(msgspec.Struct, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None      # "LOCAL" or "REMOTE" relative to the publisher (a shared tier)
    ownership: str | None = None     # which secondary offloading tier stored it
    session_id: str | None = None    # the request context that caused the store (not an owner)


class _RemovedFields(msgspec.Struct, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


# --- public event types (also the typed decoder's targets for the map form) -------------------------
class _Event(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    pass


class BlockStored(_StoredFields, _Event, tag="BlockStored"):
    """Full blocks newly cached by one request, in prefix order.

    ``token_ids`` holds the tokens of all the blocks concatenated (empty for "hash-only" events of
    an offload tier, which must be joined to hashes already known). ``parent_block_hash`` is the
    engine hash of the block before ``block_hashes[0]`` (None at the start of a sequence).
    """


class BlockRemoved(_RemovedFields, _Event, tag="BlockRemoved"):
    """Blocks evicted from one tier (``medium``); engine hashes only."""


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    """The engine's prefix cache was reset: drop everything this publisher announced."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, gc=False):
    """One published batch: wall-clock ``ts`` (Unix seconds), events, and the data-parallel rank."""

    ts: float
    events: list[Event]
    dp_rank: int | None = None


# --- typed wire decoders ----------------------------------------------------------------------------
class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _ArrEvent(msgspec.Struct, array_like=True, gc=False):
    pass


class _ArrStored(_StoredFields, _ArrEvent, tag="BlockStored"):
    pass


class _ArrRemoved(_RemovedFields, _ArrEvent, tag="BlockRemoved"):
    pass


class _ArrCleared(_ArrEvent, tag="AllBlocksCleared"):
    pass


class _ArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrStored | _ArrRemoved | _ArrCleared]
    data_parallel_rank: int | None = None


_map_decoder = msgspec.msgpack.Decoder(_MapBatch)
_arr_decoder = msgspec.msgpack.Decoder(_ArrBatch)
_any_decoder = msgspec.msgpack.Decoder()


# --- hashes -----------------------------------------------------------------------------------------
def normalize_hash(h: Any) -> int:
    """An engine block hash as uint64: ints wrap to 64 bits, bytes give their last 8 bytes."""
    if type(h) is int:
        return h & U64
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if not b:
            raise DecodeError("empty block hash")
        return int.from_bytes(b[-8:], "big")
    if isinstance(h, int) and not isinstance(h, bool):
        return int(h) & U64
    raise DecodeError(f"block hash must be an int or bytes, not {type(h).__name__}")


def normalize_hashes(hashes: list[Any]) -> list[int]:
    """A list of hashes as uint64; the all-unsigned-int list (the common case) is returned as is."""
    if not hashes:
        return hashes
    try:
        if min(hashes) >= 0 and max(hashes) <= U64:
            return hashes
    except TypeError:  # bytes mixed with ints, or all bytes
        pass
    return [normalize_hash(h) for h in hashes]


def _fix_hashes(ev: Any) -> None:
    ev.block_hashes = normalize_hashes(ev.block_hashes)
    if type(ev) is BlockStored:
        p = ev.parent_block_hash
        if p is not None and (type(p) is not int or p < 0):
            ev.parent_block_hash = normalize_hash(p)


# --- batch decoding ---------------------------------------------------------------------------------
def decode_payload(payload: bytes) -> EventBatch:
    """A msgpack batch as an :class:`EventBatch`; raises :class:`DecodeError` if it is not one.

    msgspec raises ``RecursionError`` for a payload nested about a thousand levels deep (1 KB of
    array headers does it); that is a malformed batch like any other, not a reason for the
    subscriber to drop its socket and the good batches queued behind it."""
    try:
        return _decode_payload(payload)
    except RecursionError:
        raise DecodeError("payload nests too deeply") from None


def _decode_payload(payload: bytes) -> EventBatch:
    raw: _MapBatch | _ArrBatch
    try:
        raw = _map_decoder.decode(payload)
        events = raw.events
    except (msgspec.ValidationError, msgspec.DecodeError):
        try:
            raw = _arr_decoder.decode(payload)
            events = [_from_array_struct(e) for e in raw.events]
        except (msgspec.ValidationError, msgspec.DecodeError):
            return _decode_generic(payload)
    for ev in events:
        if type(ev) is not AllBlocksCleared:
            _fix_hashes(ev)
    return EventBatch(ts=raw.ts, events=events, dp_rank=raw.data_parallel_rank)


def _from_array_struct(e: Any) -> Event:
    t = type(e)
    if t is _ArrStored:
        return BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                           token_ids=e.token_ids, block_size=e.block_size, lora_id=e.lora_id,
                           medium=e.medium, lora_name=e.lora_name, extra_keys=e.extra_keys,
                           group_idx=e.group_idx, kv_cache_spec_kind=e.kv_cache_spec_kind,
                           kv_cache_spec_sliding_window=e.kv_cache_spec_sliding_window, locality=e.locality,
                           ownership=e.ownership, session_id=e.session_id)
    if t is _ArrRemoved:
        return BlockRemoved(block_hashes=e.block_hashes, medium=e.medium, group_idx=e.group_idx,
                            locality=e.locality, ownership=e.ownership)
    return AllBlocksCleared()


# positional field order of the legacy array form, after the tag
_STORED_FIELDS = _StoredFields.__struct_fields__
_REMOVED_FIELDS = _RemovedFields.__struct_fields__


def _decode_generic(payload: bytes) -> EventBatch:
    """Tolerant path: generic msgpack, then field by field. Unknown event types are skipped."""
    try:
        obj = _any_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank", obj.get("dp_rank"))
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) >= 3 else None
    else:
        raise DecodeError("batch must be [ts, events, dp_rank], [ts, events] or a map")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise DecodeError("batch ts must be a number")
    if not isinstance(events, list):
        raise DecodeError("batch events must be an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise DecodeError("batch data_parallel_rank must be an int or nil")
    out: list[Event] = []
    for raw in events:
        ev = _generic_event(raw)
        if ev is not None:
            out.append(ev)
    return EventBatch(ts=float(ts), events=out, dp_rank=rank)


def _generic_event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:]))
    else:
        raise DecodeError("event must be a tagged map or a tagged array")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        return None  # an event type this version does not know: ignored
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list):
        raise DecodeError(f"{tag}.block_hashes must be an array")
    hashes = [normalize_hash(h) for h in hashes]
    medium = _opt(fields.get("medium"), str, "medium")
    group_idx = _opt(fields.get("group_idx"), int, "group_idx")
    locality = _opt(fields.get("locality"), str, "locality")
    ownership = _opt(fields.get("ownership"), str, "ownership")
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx, locality=locality,
                            ownership=ownership)
    parent = fields.get("parent_block_hash")
    token_ids = fields.get("token_ids") or []
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        raise DecodeError("BlockStored.token_ids must be an array of ints")
    block_size = fields.get("block_size") or 0
    if type(block_size) is not int or block_size < 0:
        raise DecodeError("BlockStored.block_size must be a non-negative int")
    extra = fields.get("extra_keys")
    return BlockStored(block_hashes=hashes, parent_block_hash=None if parent is None else normalize_hash(parent),
                       token_ids=token_ids, block_size=block_size,
                       lora_id=_opt(fields.get("lora_id"), int, "lora_id"), medium=medium,
                       lora_name=_opt(fields.get("lora_name"), str, "lora_name"),
                       extra_keys=extra if isinstance(extra, list) else None, group_idx=group_idx,
                       kv_cache_spec_kind=_opt(fields.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
                       kv_cache_spec_sliding_window=_opt(fields.get("kv_cache_spec_sliding_window"), int,
                                                         "kv_cache_spec_sliding_window"),
                       locality=locality, ownership=ownership,
                       session_id=_opt(fields.get("session_id"), str, "session_id"))


def _opt(value: Any, typ: type, name: str) -> Any:
    if value is None or (isinstance(value, typ) and not isinstance(value, bool)):
        return value
    raise DecodeError(f"field {name} must be {typ.__name__} or nil")


# --- frames -----------------------------------------------------------------------------------------
def decode_seq(raw: bytes) -> int:
    """A sequence-number frame (8 bytes big-endian, unsigned) as an int."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or not 1 <= len(raw) <= 8:
        raise DecodeError("sequence frame must be 1 to 8 bytes")
    return int.from_bytes(raw, "big")


def encode_seq(seq: int) -> bytes:
    return (seq & U64).to_bytes(8, "big")


def decode_frame(frames: list[bytes]) -> tuple[str, int, EventBatch]:
    """``[topic, seq, payload]`` as ``(topic, seq, batch)``; :class:`DecodeError` if malformed."""
    if len(frames) != 3:
        raise DecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic).decode("utf-8", errors="replace"), decode_seq(seq), decode_payload(bytes(payload))


def event_to_dict(ev: Event) -> dict[str, Any]:
    """An event as a JSON-ready dict with its ``type`` and every field (bytes never appear: hashes are ints)."""
    d: dict[str, Any] = {"type": type(ev).__name__}
    for name in ev.__struct_fields__:
        d[name] = getattr(ev, name)
    return d
