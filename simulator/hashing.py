"""Block hashes computed the way vLLM computes them, so what the simulator publishes is what a vLLM
engine with the same flags would publish for the same tokens.

vLLM (checked against 0.32's ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``):

* a block's hash is ``H((parent, tuple(token_ids), extra_keys))``: ``parent`` is the previous block's
  hash (the chain's root, ``NONE_HASH``, for the first block), ``extra_keys`` is ``None`` or a tuple
  of tagged keys: ``("lora", name, path)`` on every block of an adapter's request, ``("cache_salt",
  salt)`` on the first block of a salted request (multimodal and prompt-embeds keys too, which the
  simulator has no use for);
* ``H`` is chosen by ``--prefix-caching-hash-algo``: ``sha256`` (the default: SHA-256 of the object
  pickled at the highest protocol), ``sha256_cbor`` (SHA-256 of its canonical CBOR), ``xxhash`` and
  ``xxhash_cbor`` (XXH3-128 of the same two encodings);
* ``NONE_HASH = H(seed)`` for the seed string: ``PYTHONHASHSEED`` when set; otherwise the fixed
  ``"vllm-none-hash"`` for the two SHA-256 algorithms (so every engine agrees) and 32 random bytes,
  in hex, for the two xxhash ones (not collision resistant, so the seed is kept secret);
* an event carries a hash as the digest's low 64 bits, big-endian (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
  on by default), and its ``extra_keys`` untagged: the salt or the adapter name alone.

kvroute's router never depends on these values: it keys its index from the token ids in the events.
They matter to tools and peer routers that read engine hashes.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"

HashFn = Callable[[Any], bytes]


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        try:
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
        except struct.error:
            continue
    raise ValueError(f"integer {n} does not fit CBOR's 64 bits")


def cbor(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949, shortest forms) of the values a block hash is made of: None, bools,
    integers, bytes, strings and tuples or lists of them."""
    if obj is None:
        return b"\xf6"
    if obj is True or obj is False:
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"no CBOR encoding here for {type(obj).__name__}")


def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - xxhash is a dependency
        raise ValueError("the xxhash algorithms need the 'xxhash' package") from exc
    return xxhash.xxh3_128_digest


def hash_function(algo: str) -> HashFn:
    """vLLM's ``--prefix-caching-hash-algo`` by name."""
    if algo == "sha256":
        return lambda obj: hashlib.sha256(_pickled(obj)).digest()
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(cbor(obj)).digest()
    if algo == "xxhash":
        xxh = _xxh3_128()
        return lambda obj: xxh(_pickled(obj))
    if algo == "xxhash_cbor":
        xxh = _xxh3_128()
        return lambda obj: xxh(cbor(obj))
    raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")


def none_hash_seed(algo: str, seed: str | None = None) -> str:
    """The seed the chain's root is derived from: ``seed`` if given, else as vLLM resolves it."""
    if seed is not None:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    return os.urandom(32).hex() if algo.startswith("xxhash") else DEFAULT_SEED


class BlockHasher:
    """One engine's hashing: the algorithm, its root and the chain."""

    def __init__(self, algo: str = "sha256", seed: str | None = None):
        self.algo = algo
        self.fn = hash_function(algo)
        self.seed = none_hash_seed(algo, seed)
        self.root = self.fn(self.seed)

    def chain(self, parent: bytes | None, token_ids: Sequence[int], block_size: int,
              first_keys: tuple | None = None, every_keys: tuple | None = None) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids``, chained from ``parent`` (the root when None).

        ``first_keys`` are extra keys of the first of these blocks only (a salt, when this run starts
        the prompt), ``every_keys`` those of every block (an adapter)."""
        fn = self.fn
        out = []
        h = self.root if parent is None else parent
        every = tuple(every_keys or ())
        for i in range(len(token_ids) // block_size):
            keys = every + tuple(first_keys or ()) if i == 0 else every
            h = fn((h, tuple(token_ids[i * block_size:(i + 1) * block_size]), keys or None))
            out.append(h)
        return out


def external(digest: bytes) -> int:
    """The hash as an event carries it: the digest's low 64 bits, read big-endian."""
    return int.from_bytes(digest[-8:], "big")
