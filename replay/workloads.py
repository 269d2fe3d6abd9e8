"""Workloads: traces and synthetic shapes turned into a deterministic list of request specs.

A prompt is described by *segments*: references to fixed, deterministic token blocks held by a
``TokenBank``. Two requests that name the same segment send the same token ids at that point, so
shared trace hash ids become shared prompt prefixes without ever storing a whole prompt per
request (a 60 s slice of the Mooncake trace is thousands of 10k-token prompts). Token ids are
drawn from ``range(vocab_size)``; the default 256 keeps them inside the byte tokenizer's ordinary
ids (256/257 are its BOS/EOS).

Generators:

* ``mooncake(path)``: Mooncake JSONL; each hash id is one block of ``block_size`` ids (512 by
  default), the last block cut so the prompt is exactly ``input_length`` long
  (``len(hash_ids) == ceil(input_length / block_size)``).
* ``azure(path)``: the Azure LLM inference CSV; lengths and timestamps, every prompt unique.
* ``multiturn(...)``: sessions bound to one of N system prompts; turn k sends the system prompt
  plus the user text of turns 0..k (each turn appends ``turn_tokens`` new ids).
* ``shared_prefix(...)``: inference-perf's shape (groups sharing a system prompt, unique questions).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import orjson

# Namespaces keep the blocks of different generators apart in the bank.
NS_MOONCAKE = 1
NS_AZURE = 2
NS_SYSTEM = 3
NS_TURN = 4
NS_QUESTION = 5

# Longest prompt or output a trace row or flag may ask for: a clear error above it, not a hang building
# millions of blocks or a body whose max_tokens JSON cannot encode.
MAX_TOKENS = 100_000_000
MAX_REQUESTS = 10_000_000  # requests a synthetic workload may build

# Printable ASCII used for text prompts (chat endpoints): token id -> one character.
_PRINTABLE = "".join(chr(c) for c in range(33, 127))


class TraceError(ValueError):
    """A trace file or workload spec that cannot be used; the message names the file and line."""


Segment = tuple[tuple[int, ...], int]  # (bank key, number of leading ids of that block used)


class TokenBank:
    """Deterministic token blocks keyed by small integer tuples, generated on first use.

    The ids of block ``key`` depend only on ``(seed, key)``, never on the order blocks are asked
    for, so a request's prompt is the same whichever subset of a trace is replayed. The JSON and
    text renderings are cached per block, which makes encoding a request a byte-string join.
    """

    def __init__(self, seed: int = 0, vocab_size: int = 256):
        if vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seed = int(seed)
        self.vocab_size = int(vocab_size)
        self._block_lengths: dict[tuple[int, ...], int] = {}
        self._ids: dict[tuple[int, ...], np.ndarray] = {}
        self._json: dict[tuple[tuple[int, ...], int], bytes] = {}
        self._text: dict[tuple[int, ...], str] = {}

    def declare(self, key: tuple[int, ...], length: int) -> None:
        """Fix the full length of block ``key`` (a partial use is always a prefix of it)."""
        known = self._block_lengths.get(key)
        if known is None or length > known:
            self._block_lengths[key] = length
            self._ids.pop(key, None)
            self._text.pop(key, None)
            for k in [k for k in self._json if k[0] == key]:
                del self._json[k]

    def ids(self, key: tuple[int, ...]) -> np.ndarray:
        arr = self._ids.get(key)
        if arr is None:
            length = self._block_lengths[key]
            rng = np.random.default_rng([self.seed, *key])
            arr = rng.integers(0, self.vocab_size, size=length, dtype=np.int64)
            self._ids[key] = arr
        return arr

    def json_fragment(self, key: tuple[int, ...], length: int) -> bytes:
        """The first ``length`` ids of the block as comma-separated JSON numbers (no brackets)."""
        frag = self._json.get((key, length))
        if frag is None:
            frag = orjson.dumps(self.ids(key)[:length].tolist())[1:-1]
            self._json[(key, length)] = frag
        return frag

    def text(self, key: tuple[int, ...], length: int) -> str:
        """The first ``length`` ids rendered as printable characters (one character per id)."""
        full = self._text.get(key)
        if full is None:
            full = "".join(_PRINTABLE[i % len(_PRINTABLE)] for i in self.ids(key).tolist())
            self._text[key] = full
        return full[:length]

    def release_ids(self) -> None:
        """Drop the cached numpy arrays (the JSON/text caches stay) to save memory after encoding."""
        self._ids.clear()


@dataclass(slots=True)
class RequestSpec:
    """One request to send: its prompt (as bank segments), output length and trace timestamp."""

    index: int
    segments: tuple[Segment, ...]
    output_len: int
    bank: TokenBank = field(repr=False)
    timestamp: float | None = None  # seconds from the trace's start, when the workload has one
    system_segments: int = 0  # leading segments sent as the system message on chat endpoints
    session: int | None = None
    turn: int | None = None
    group: int | None = None

    @property
    def input_len(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def token_ids(self) -> list[int]:
        out: list[int] = []
        for key, n in self.segments:
            out.extend(self.bank.ids(key)[:n].tolist())
        return out

    def prompt_json(self) -> bytes:
        """The prompt as a JSON array of ids, built from cached per-block fragments."""
        return b"[" + b",".join(self.bank.json_fragment(k, n) for k, n in self.segments if n) + b"]"

    def messages(self) -> list[dict[str, str]]:
        """Chat messages: the system segments as a system message, the rest as one user message."""
        system = "".join(self.bank.text(k, n) for k, n in self.segments[: self.system_segments])
        user = "".join(self.bank.text(k, n) for k, n in self.segments[self.system_segments:])
        msgs = []
        if system:
            msgs.append({"role": "system", "content": system})
        msgs.append({"role": "user", "content": user})
        return msgs

    def truncated(self, max_len: int) -> RequestSpec:
        """The same request with its prompt cut to at most ``max_len`` tokens (prefix kept)."""
        if self.input_len <= max_len:
            return self
        segs: list[Segment] = []
        left = max_len
        for key, n in self.segments:
            if left <= 0:
                break
            take = min(n, left)
            segs.append((key, take))
            left -= take
        return RequestSpec(self.index, tuple(segs), self.output_len, self.bank, self.timestamp,
                           min(self.system_segments, len(segs)), self.session, self.turn, self.group)


def _reindex(specs: list[RequestSpec]) -> list[RequestSpec]:
    for i, s in enumerate(specs):
        s.index = i
    return specs


def _positive_int(value: object, what: str, where: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TraceError(f"{where}: {what} must be an integer, got {value!r}")
    v = int(value)
    if v < 0 or (v == 0 and not allow_zero):
        raise TraceError(f"{where}: {what} must be {'>= 0' if allow_zero else '> 0'}, got {v}")
    if v > MAX_TOKENS:
        raise TraceError(f"{where}: {what} must be at most {MAX_TOKENS}, got {v}")
    return v


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise TraceError(f"--block-size must be > 0, got {block_size}")


def mooncake(path: str | Path, *, block_size: int = 512, seed: int = 0, vocab_size: int = 256,
             bank: TokenBank | None = None) -> list[RequestSpec]:
    """Requests of a Mooncake trace (JSONL with timestamp ms, input_length, output_length, hash_ids).

    Hash id ``h`` always maps to the same block of ``block_size`` ids; a request whose
    ``input_length`` is not a multiple of the block size uses only the first
    ``input_length - (n-1)*block_size`` ids of its last block, so a partial block is a prefix of the
    full one (as vLLM's timed-trace replay does). ``len(hash_ids)`` must equal
    ``ceil(input_length / block_size)``.
    """
    _check_block_size(block_size)
    bank = bank or TokenBank(seed, vocab_size)
    p = Path(path)
    try:
        lines = p.read_bytes().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror or exc}") from exc
    specs: list[RequestSpec] = []
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise TraceError(f"{where}: expected a JSON object")
        for name in ("timestamp", "input_length", "output_length", "hash_ids"):
            if name not in row:
                raise TraceError(f"{where}: missing field {name!r}")
        ts = row["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0 or not math.isfinite(ts):
            raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {ts!r}")
        n_in = _positive_int(row["input_length"], "input_length", where)
        n_out = _positive_int(row["output_length"], "output_length", where)
        hashes = row["hash_ids"]
        if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                   for h in hashes):
            raise TraceError(f"{where}: hash_ids must be a list of integers, each >= 0")
        expected = math.ceil(n_in / block_size)
        if len(hashes) != expected:
            raise TraceError(f"{where}: {len(hashes)} hash_ids for input_length {n_in}, expected "
                             f"ceil({n_in}/{block_size}) = {expected} (wrong --block-size?)")
        segs: list[Segment] = []
        for j, h in enumerate(hashes):
            key = (NS_MOONCAKE, h)
            bank.declare(key, block_size)
            segs.append((key, min(block_size, n_in - j * block_size)))
        specs.append(RequestSpec(len(specs), tuple(segs), n_out, bank, timestamp=float(ts) / 1000.0,
                                 system_segments=0))
    if not specs:
        raise TraceError(f"{p}: the trace holds no requests")
    specs.sort(key=lambda s: s.timestamp or 0.0)  # stable: ties keep file order
    return _reindex(specs)


def _parse_azure_time(text: str, where: str) -> float:
    """Seconds since the epoch for an Azure timestamp like '2023-11-16 18:15:46.6805900'."""
    text = text.strip()
    try:
        if "." in text:
            head, frac = text.split(".", 1)
            base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
            return base.timestamp() + float("0." + frac)
        return datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError as exc:
        raise TraceError(f"{where}: bad TIMESTAMP {text!r}") from exc


def azure(path: str | Path, *, block_size: int = 512, seed: int = 0, vocab_size: int = 256,
          bank: TokenBank | None = None) -> list[RequestSpec]:
    """Requests of the Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens).

    The trace has no prefix information, so every prompt is made of blocks private to its row.
    """
    _check_block_size(block_size)
    bank = bank or TokenBank(seed, vocab_size)
    p = Path(path)
    try:
        fh = p.open(newline="")
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror or exc}") from exc
    specs: list[RequestSpec] = []
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        cols = [c.strip() for c in header or []]
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        if any(c not in cols for c in need):
            raise TraceError(f"{p}:1: expected a header with {', '.join(need)}, got {cols}")
        i_ts, i_in, i_out = (cols.index(c) for c in need)
        for lineno, row in enumerate(reader, start=2):
            if not row or not any(cell.strip() for cell in row):
                continue
            where = f"{p}:{lineno}"
            if len(row) < len(cols):
                raise TraceError(f"{where}: expected {len(cols)} columns, got {len(row)}")
            ts = _parse_azure_time(row[i_ts], where)
            try:
                n_in, n_out = int(row[i_in]), int(row[i_out])
            except ValueError as exc:
                raise TraceError(f"{where}: ContextTokens and GeneratedTokens must be integers") from exc
            if n_in <= 0 or n_out < 0:
                raise TraceError(f"{where}: token counts must be positive, got {n_in}, {n_out}")
            if max(n_in, n_out) > MAX_TOKENS:
                raise TraceError(f"{where}: token counts must be at most {MAX_TOKENS}, got {n_in}, {n_out}")
            idx = len(specs)
            segs: list[Segment] = []
            for j in range(math.ceil(n_in / block_size)):
                key = (NS_AZURE, idx, j)
                bank.declare(key, block_size)
                segs.append((key, min(block_size, n_in - j * block_size)))
            specs.append(RequestSpec(idx, tuple(segs), max(1, n_out), bank, timestamp=ts))
    if not specs:
        raise TraceError(f"{p}: the trace holds no requests")
    t0 = min(s.timestamp or 0.0 for s in specs)  # the earliest row, wherever it is in the file
    for s in specs:
        s.timestamp = (s.timestamp or 0.0) - t0
    specs.sort(key=lambda s: s.timestamp or 0.0)
    return _reindex(specs)


def multiturn(*, system_prompts: int = 20, system_prompt_len: int = 2048, sessions: int = 400,
              turns: int = 5, turn_tokens: int = 300, output_len: int = 100, seed: int = 0,
              vocab_size: int = 256, bank: TokenBank | None = None) -> list[RequestSpec]:
    """Synthetic chat sessions that grow turn by turn.

    Session ``s`` is tied to system prompt ``s % system_prompts``. Turn ``k`` (0-based) sends the
    session's system prompt followed by the user text of turns 0..k, each ``turn_tokens`` fresh ids,
    so its prompt is ``system_prompt_len + (k+1)*turn_tokens`` long and the previous turn's prompt
    is an exact prefix of it. The model's replies are not fed back (they are not known when the
    requests are built). The order interleaves sessions, seeded: turn k of a session always comes
    after its turn k-1.
    """
    for name, v in (("system_prompts", system_prompts), ("sessions", sessions), ("turns", turns),
                    ("output_len", output_len)):
        if v <= 0:
            raise TraceError(f"multiturn: {name} must be > 0, got {v}")
    if system_prompt_len < 0 or turn_tokens <= 0:
        raise TraceError("multiturn: system_prompt_len must be >= 0 and turn_tokens > 0")
    if sessions * turns > MAX_REQUESTS or system_prompt_len + turns * turn_tokens > MAX_TOKENS:
        raise TraceError(f"multiturn: at most {MAX_REQUESTS} requests (sessions x turns) of at most {MAX_TOKENS} "
                         f"tokens (system_prompt_len + turns x turn_tokens)")
    bank = bank or TokenBank(seed, vocab_size)
    rng = np.random.default_rng([seed, 7])
    order = np.repeat(np.arange(sessions), turns)
    rng.shuffle(order)
    next_turn = [0] * sessions
    specs: list[RequestSpec] = []
    for s in order.tolist():
        k = next_turn[s]
        next_turn[s] += 1
        segs: list[Segment] = []
        n_sys = 0
        if system_prompt_len:
            sys_key = (NS_SYSTEM, s % system_prompts)
            bank.declare(sys_key, system_prompt_len)
            segs.append((sys_key, system_prompt_len))
            n_sys = 1
        for j in range(k + 1):
            key = (NS_TURN, s, j)
            bank.declare(key, turn_tokens)
            segs.append((key, turn_tokens))
        specs.append(RequestSpec(len(specs), tuple(segs), output_len, bank, system_segments=n_sys,
                                 session=s, turn=k, group=s % system_prompts))
    return specs


def shared_prefix(*, num_groups: int = 10, prompts_per_group: int = 10, system_prompt_len: int = 2048,
                  question_len: int = 256, output_len: int = 128, seed: int = 0, vocab_size: int = 256,
                  bank: TokenBank | None = None) -> list[RequestSpec]:
    """inference-perf's shared-prefix shape: ``num_groups`` system prompts, each followed by
    ``prompts_per_group`` unique questions; requests in a seeded random order."""
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                    ("question_len", question_len), ("output_len", output_len)):
        if v <= 0:
            raise TraceError(f"shared-prefix: {name} must be > 0, got {v}")
    if num_groups * prompts_per_group > MAX_REQUESTS or system_prompt_len + question_len > MAX_TOKENS:
        raise TraceError(f"shared-prefix: at most {MAX_REQUESTS} requests (num_groups x prompts_per_group) of at "
                         f"most {MAX_TOKENS} tokens")
    bank = bank or TokenBank(seed, vocab_size)
    pairs = [(g, q) for g in range(num_groups) for q in range(prompts_per_group)]
    order = np.random.default_rng([seed, 11]).permutation(len(pairs)).tolist()
    specs: list[RequestSpec] = []
    for i in order:
        g, q = pairs[i]
        segs: list[Segment] = []
        if system_prompt_len:
            sys_key = (NS_SYSTEM, g)
            bank.declare(sys_key, system_prompt_len)
            segs.append((sys_key, system_prompt_len))
        key = (NS_QUESTION, g, q)
        bank.declare(key, question_len)
        segs.append((key, question_len))
        specs.append(RequestSpec(len(specs), tuple(segs), output_len, bank,
                                 system_segments=1 if system_prompt_len else 0, group=g))
    return specs


def limit_input_len(specs: Iterable[RequestSpec], max_len: int | None, policy: str = "truncate") -> list[RequestSpec]:
    """Apply ``--max-input-len``: cut longer prompts to ``max_len`` (prefix kept) or skip them."""
    specs = list(specs)
    if not max_len:
        return specs
    if policy == "skip":
        return _reindex([s for s in specs if s.input_len <= max_len])
    return _reindex([s.truncated(max_len) for s in specs])
