"""Router-side block keys: our own chained 64-bit hash over full blocks of token ids.

The router never recomputes vLLM's block hashes (they depend on the engine's hash function, its
seed and its version). It names a block by a key of its own, computed the same way for a request's
prompt and for the ``token_ids`` a BlockStored event carries, so both sides meet in one key space:

    key_0 = H(seed, tokens[0:B]);  key_i = H(key_{i-1}, tokens[iB:(i+1)B])

Only full blocks get a key (vLLM caches only full blocks). The chain makes a key name the whole
prefix up to its block, so a lookup can walk a prompt's keys and stop at the first miss. The seed
comes from the model and LoRA adapter name, so two models or two adapters never share a key.

H is CPython's ``hash()`` of a small tuple (an xxHash-style mix of the element hashes, done in C),
masked to 60 bits so every key is a compact one-word int object. Measured on this project's build
machine (32k tokens, block 16; see docs/indexer.md): tuple ``hash()`` ~200-360 ns/block,
xxhash ``xxh3_64`` over the packed block ~450 ns/block (the per-block Python call and buffer
slicing dominate), ``hashlib.blake2b`` ~1,240 ns/block. Tuple hashing of ints is deterministic
across processes (only str/bytes hashing is salted), but it is not a wire format: another Python
version or build may hash a tuple differently. So keys leave a router process only for a process
that checks it computes the same ones: its tokenize process (the same Python: router/tokenize_proc.py),
and the other workers and replicas on the booking bus, whose credits are taken only if their
:func:`key_space` is the receiver's own (router/bookbus.py). They are never stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

KEY_BITS = 60
KEY_MASK = (1 << KEY_BITS) - 1


def key_seed(model: str, lora_name: str | None = None) -> int:
    """The chain's starting value for one model (and LoRA adapter): stable, 60 bits."""
    text = f"{model}\x00{lora_name or ''}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8, person=b"kvroute-key").digest(), "big") & KEY_MASK


def key_space(block_size: int) -> str:
    """A name for the keys this process computes: the block size and the key of one probe block.
    Two processes whose names agree key every prompt alike (the same block size and tuple hash)."""
    probe = block_keys(list(range(block_size)), block_size, key_seed("kvroute-key-space"))[0]
    return f"{block_size}:{probe:015x}"


def _extra_digest(extra: Any) -> int:
    """A stable int for a block's extra hash keys (LoRA name, multimodal ids, cache salt)."""
    try:
        raw = msgspec.msgpack.encode(extra)
    except (TypeError, msgspec.EncodeError):
        raw = repr(extra).encode("utf-8", errors="replace")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def block_keys(token_ids: Sequence[int], block_size: int, seed: int,
               extra_keys: list[Any] | None = None) -> list[int]:
    """Keys of every full ``block_size`` block of ``token_ids``, chained from ``seed``.

    ``seed`` is :func:`key_seed` for a prompt, or the parent block's key when continuing a chain
    (a BlockStored event whose first block follows an already known block). ``extra_keys``, one
    entry per block (None for none), folds the engine's per-block extra hash keys in, so a block
    salted or carrying image tokens never matches a plain-token prompt.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[int] = []
    append = out.append
    k = seed
    mask = KEY_MASK
    if extra_keys is None or extra_keys.count(None) == len(extra_keys):  # vLLM sends [None] * n
        for chunk in zip(*[iter(token_ids)] * block_size):
            k = hash((k, chunk)) & mask
            append(k)
        return out
    for i, chunk in enumerate(zip(*[iter(token_ids)] * block_size)):
        extra = extra_keys[i] if i < len(extra_keys) else None
        if extra is None:
            k = hash((k, chunk)) & mask
        else:
            k = hash((k, chunk, _extra_digest(extra))) & mask
        append(k)
    return out


def prompt_keys(token_ids: Sequence[int], block_size: int, model: str, lora_name: str | None = None) -> list[int]:
    """Convenience: the keys of a prompt for ``model`` (and adapter), as the router computes them."""
    return block_keys(token_ids, block_size, key_seed(model, lora_name))
