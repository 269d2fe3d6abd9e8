"""Tokenize only what is new: a cache of the token ids of text prefixes already seen.

Multi-turn traffic sends the same long prefix every turn (the system prompt, then the whole
conversation so far) plus a few hundred new tokens. ``PrefixTokenCache`` wraps a Hugging Face
tokenizer and remembers, for text it has tokenized, the tokens of each *chunk* of the text, keyed
by a chained hash of the chunks up to it (so a key stands for the whole prefix, not the chunk
alone). A new text whose leading chunks are known reuses their tokens and tokenizes the rest only.

**Exact at chunk boundaries.** A chunk ends just before a space that follows a letter or digit
(after at least ``chunk_chars`` characters). The tokenizers this router meets split words before
the model runs: byte-level BPE (GPT-2's and Llama 3's regexes), WordPiece (whitespace and
punctuation) and SentencePiece-style Metaspace all start a new piece at such a space and never
merge across it, and the scan from that space on does not depend on what came before. So the
tokens of ``text`` are the tokens of ``text[:p]`` followed by those of ``text[p:]``, and the new
part of a text is tokenized as its chunks, each on its own, in one batch call: the tokens of each
new chunk come out as they are to be stored, with no offsets to read. The special tokens a
post-processor adds (BOS, or ``[CLS]``/``[SEP]``) are learnt once from a probe and added around
the body. A tokenizer is checked for the property once, when the cache is made (``cut_problem``):
no token of its vocabulary may hold a space after a letter or digit (a token could then span a
chunk end), and a probe text of words, digits, punctuation, runs of spaces and newlines, cut at
every chunk end, must tokenize as it does whole (a normalizer that prepends a marker to every
text, as Llama 2's does, fails here). A tokenizer that fails is used without the cache
(``disabled``, ``disabled_reason``). ``tests/test_prefix_tokens.py`` checks the property on random
texts and chat histories for byte-level BPE, WordPiece and Unigram tokenizers, and at run time one
cache hit in ``verify_every`` is also tokenized whole, in a background thread (so no request waits
for it), and compared: on a mismatch the cache turns itself off and the router goes on with full
tokenization. The checks take at most ``verify_share`` of the tokenizing's CPU time (each thread's
own, ``time.thread_time``: the checks' against the cache's new pieces'): a check re-tokenizes the
whole prompt, so at 8k-token follow-ups one in 64 cost more CPU than the new words of all 64 (18 ms
against ~1 ms each). Until 2026-12-05 the share was counted in tokens; with tiktoken's twin doing
the cache's tokenizing (145 ns a token) and the tokenizers library the checks' (726 ns), a tenth
of the tokens was half as much CPU again as the tokenizing (docs/router.md, "The checks' share in
CPU time").

**Off the GIL.** ``Tokenizer.encode`` holds the GIL for the whole encode (about 50 ms for a
35k-token text on the build machine: ``bench/gil_hold.py``), so a big prompt tokenized in a thread
still stalled the event loop. The batch calls release it while Rust works, and the cache uses only
them (``encode_batch_fast``: no offsets). Until 2026-12-04 the new part was tokenized whole with
offsets and each chunk end looked up in them (a galloping search over ``token_to_chars``); cutting
it into chunks first leaves nothing to search, and new 32k-token conversations of
``bench/prompt_stages.py`` tokenize in 35.7 ms where they took 56.1 ms (8k-token follow-ups 0.57
against 0.80 ms; docs/router.md, "Chunks tokenized one by one"). The batch of chunks is
tokenized on one thread: ``kvroute serve`` sets ``TOKENIZERS_PARALLELISM=false`` unless it is set,
since the library's worker threads would spin on the router's other core for the same tokens (a
throwaway harness: a cold 27k-token text took 20 ms on two threads but 38 ms of CPU, 28 ms on one).

**tiktoken where it gives the same ids.** For a byte-level BPE tokenizer the cache tokenizes through
``indexer.fast_bpe.twin``: tiktoken's BPE on the same vocabulary, about a third of the cost, checked
at start against the tokenizers library. The run-time checks above compare with the tokenizers
library itself, so they watch the twin too: a difference that the twin alone makes drops the twin
(and the chunks it tokenized), not the cache; short texts, which skip the cache, are checked one
in ``verify_every`` as well, on the spot rather than in the check thread. Handing a check to the
thread costs the event loop GIL handoffs (the thread waits for the loop to let go of the GIL,
then the loop waits for the thread): on 20-token chat prompts at 32 connections, one process
served 4,361 req/s with those checks in the thread against 4,589 without them (four alternating
pairs, 2026-12-05), while the check itself is 27 µs of one request in 64. A long text's check
(the whole prompt again, milliseconds) stays in the thread, where the tokenizers library runs
it without the GIL.

**Block keys too, without a token list.** Routing needs a prompt's length and its block keys, not
its token ids. ``encode_cached`` answers with ``CachedTokens``: the reused chunks as they sit in
the cache plus the new part, materialised as a list only if someone asks for one. Its
``block_keys`` looks up the keys of the reused prefix in a second small cache (keyed by the chain
hash of that prefix, the block size, the key seed and a 128-bit digest of the adapter and salt:
``_memo_tag``), so a follow-up hashes only its last partial block and its new tokens; then it
remembers the keys through this text's last cached chunk for the next turn. On a warm 9k-token
follow-up this removes building a 9,000-int list and hashing 570 blocks
(``bench/prompt_stages.py``). When the last reused chunk has no keys remembered, the chunks before
it are tried, back to ``MAX_KEY_PROBES``: with workers or replicas a conversation's turns alternate
between processes, which share chunks but not keys, so a turn finds the keys of the last turn its
own process served and hashes only the blocks after it (a throwaway harness, two workers, the
bench's 32k-token chat sent one at a time over 8 connections: keys found for 37-61 % of reused
prefixes before, 94-97 % after; median 5.3/5.1 -> 4.7/4.9 ms). The keys are what
``indexer.keys.block_keys`` gives for the full token list (a test checks it on branches, salts and
adapters).

**Shared between processes.** A chunk's key chains xxh3 hashes (``chain_key``), the same in every
process, so workers and replicas can hand each other what they tokenized: ``on_stored`` is called
with each text's newly stored chunks, and ``adopt`` takes another process's (the booking bus
carries them, checked against this tokenizer's ``fingerprint``: ``router/bookbus.py``).

**Salted texts chain apart.** A request with a ``cache_salt`` has its chain start from
``salt_seed(salt)`` rather than 0 (``encode_cached(..., seed=)``: router/prompts.py), so its chunks,
and the notes kept under its first chunk's key, are found only by texts of the same salt: another
tenant cannot tell by the router's tokenizing time whether it sent the same text (a cold 8.8k-token
chat prompt took 2.4 ms, the same with another tenant's chunks cached 0.57 ms: docs/reliability.md,
"Tenants that never share a prefix cache"). Shared chunks carry their seeded keys as they are.

**A chunk's tokens are bytes**: its token ids as native-order uint32 (``array("I").tobytes()``),
here, between the router and its tokenize process, and on the booking bus (little-endian there).
Not ``array`` objects, which the garbage collector tracks on Python 3.11: a cache of 4M tokens holds
~70,000 chunks, and each full collection walked them all (8-10 ms over ~60,000 objects at 32
connections of 8k follow-ups: docs/router.md, "The prefix token cache's chunks out of the garbage
collector's way"); ``bytes`` are never tracked. A chunk whose tokens are asked for
(``CachedTokens``: the last one or two of a follow-up's history, for its block keys) is copied
into an array then.

**A follow-up is cut from its last turn's note.** Finding the cached prefix means cutting the text
at its chunk ends and chain-hashing every chunk, the known ones too (at 32k tokens most of the time
the cache took). So each text's ends and keys are noted under its first chunk (``_cut``); a later
text that holds a noted one through its last chunk end (its last 64 characters there equal, and
then the hash of all before them) takes them and cuts and hashes only what follows.

**And takes its history's chunks on that note's word.** Looking up and touching (least recently
used order) the ~170 chunks of an 8k-token history took ~80 µs of a follow-up's ~350 in the cache's
big map. Once a noted text's chunks are stored, its note records how many tokens they hold and the
count of tokens ever stored when they were all last touched; until enough have been stored since for
eviction to reach the first of them (``_vouches``: ``max_tokens`` less the note's tokens, less four
a character of the new text), a text that holds the note skips them: its length comes from the
note, and a chunk's tokens are looked up only if asked for (the key memo usually makes only the
last one needed). A new note keeps the older touch for the chunks it was vouched for. Clearing the
chunks starts a new ``_generation`` that no note vouches in; a chunk found gone anyway (another
thread storing meanwhile) is tokenized again and counted (``vouched_missing``).

Memory is bounded by ``max_tokens`` (tokens held, as 4-byte arrays), the keys by
``max_tokens // 4`` (8-byte arrays, each under a key of fixed size: until 2026-12-06 it held the
request's ``cache_salt`` itself, which a client may make megabytes long, and 300 requests with
distinct 1 MB salts kept 300 MB), each with least-recently-used eviction, and the notes by
``max_tokens // 16`` chunk ends (16 bytes each) and eight per first chunk; a missing link ends the
reusable prefix there.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate, chain
from time import thread_time
from typing import Any, overload

import xxhash

from indexer.keys import block_keys

MIN_CHARS = 2048  # shorter texts are tokenized whole: the bookkeeping would cost more than it saves
MAX_KEY_PROBES = 64  # earlier chunk ends looked up for remembered block keys when the last one has none
NOTES_PER_HEAD = 8  # texts remembered per first chunk by ``PrefixTokenCache._cut`` (the latest first)
NOTE_TAIL = 64  # characters through a noted text's last chunk end, compared before its hash


class NotCached(Exception):
    """``encode_cached(..., max_new_chars=n)``: more than ``n`` characters of the text are not in the
    cache (nothing was tokenized or stored)."""


@dataclass
class CacheStats:
    hits: int = 0            # texts that reused at least one chunk
    misses: int = 0          # texts long enough to use the cache that reused nothing
    reused_tokens: int = 0
    tokenized_tokens: int = 0
    verified: int = 0
    verified_tokens: int = 0  # tokens tokenized again by the checks
    tokenize_seconds: float = 0.0  # CPU time (its thread's) spent tokenizing the cache's new pieces
    verify_seconds: float = 0.0    # CPU time the checks spent (re-tokenizing and comparing)
    mismatches: int = 0
    key_hits: int = 0        # cached texts whose prefix's block keys were remembered (or an earlier prefix's)
    key_misses: int = 0
    adopted: int = 0         # chunks taken from other processes (``adopt``)
    vouched: int = 0         # texts whose reused chunks a note vouched for (not looked up: ``_vouches``)
    vouched_missing: int = 0  # such chunks found gone after all when their tokens were asked for (never, so far)
    extra: dict[str, int] = field(default_factory=dict)


def boundaries(text: str, chunk_chars: int, start: int = 0) -> list[int]:
    """Chunk ends: positions p >= the previous end + ``chunk_chars`` with ``text[p] == " "`` and
    ``text[p - 1]`` a letter or digit (``str.isalnum``). ``str.find`` from each start, not a regex
    search: 50 against 32 µs for an 8k-token chat text (throwaway microbenchmark). ``start``: a chunk
    end already known (those after it depend on nothing before it)."""
    out = []
    n = len(text)
    pos = start + chunk_chars
    find = text.find
    while pos < n:
        p = find(" ", pos)
        while p > 0 and not text[p - 1].isalnum():
            p = find(" ", p + 1)
        if p < 0:
            break
        out.append(p)
        pos = p + chunk_chars
    return out


# words, digits, punctuation, runs of spaces and newlines, non-ASCII letters: every kind of text that
# follows a chunk end (a space after a letter or digit), for ``cut_problem``
PROBE = ("The quick brown fox jumps over 13 lazy dogs  Then   it rests \n and \tnaps 2024 times it's "
         "3.14 or 1e10 (maybe) [yes] {no} \"quoted\" 'single' a-b a_b x3 -- ... \n\n    indented code # note "
         "\n\tcafé naïve 東京 数据 données ok? yes: no! 100 % A1 b2 C3 \u00a0 end .\n")


def cut_problem(hf: Any) -> str | None:
    """Why cutting texts at chunk ends could change what ``hf`` (a ``tokenizers.Tokenizer``) makes of
    them, or None: a token of its vocabulary that holds a space after a letter or digit (it could
    span a chunk end), or a probe text whose chunks tokenized one by one differ from it tokenized
    whole (a normalizer or pre-tokenizer that treats a text's start apart)."""
    ids = sorted(set(hf.get_vocab(with_added_tokens=True).values()))
    texts = hf.decode_batch([[i] for i in ids], skip_special_tokens=False)
    joined = "\x00".join(texts)  # one scan: the separator is neither a space nor a letter or digit
    found = boundaries(joined, 1)
    if found:
        i = bisect_right(list(accumulate(len(t) + 1 for t in texts)), found[0])  # the token it falls in
        return f"token {ids[i]} ({texts[i]!r}) holds a space after a letter or digit"
    ends = boundaries(PROBE, 1)
    pieces = [PROBE[a:b] for a, b in zip([0, *ends], [*ends, len(PROBE)], strict=True)]
    batch = batch_encoder(hf)
    cut = [t for e in batch(pieces, add_special_tokens=False) for t in e.ids]
    if cut != batch([PROBE], add_special_tokens=False)[0].ids:
        return "a probe text tokenized chunk by chunk differs from it tokenized whole"
    return None


def chain_key(prev: int, chunk: str) -> int:
    """The key of a prefix: its last chunk hashed with the key of the prefix before it as seed (for
    the first, the text's seed: 0, or a salted request's ``salt_seed``). xxh3, not ``hash()``:
    Python's string hash differs per process, and workers and replicas share their chunks by these
    keys (``PrefixTokenCache.share``)."""
    return xxhash.xxh3_64_intdigest(chunk.encode("utf-8", "surrogatepass"), prev)


SALT_SEED_DOMAIN = b"kvroute/prefix-token-chain-seed/v1\x00"


def salt_seed(salt: str) -> int:
    """The seed a request's chunk-key chains start from when it carries ``cache_salt`` ``salt`` (never
    0, the seed of unsalted texts): its chunks are found only by texts of the same salt, so no tenant
    can tell by the router's tokenizing time what another tenant's prompts were (docs/reliability.md,
    "Tenants that never share a prefix cache"). The salt of an API key with a ``cache_salt`` is
    derived from its secret, so this seed cannot be guessed by another tenant either. 64 bits, like
    the chain keys it starts."""
    return xxhash.xxh3_64_intdigest(SALT_SEED_DOMAIN + salt.encode("utf-8", "surrogatepass")) or 1


def chain_keys(text: str, ends: Sequence[int], start: int = 0, key: int = 0) -> list[int]:
    """``chain_key`` of each prefix of ``text`` through ``ends``. An ASCII text (its characters are
    its UTF-8 bytes) is encoded once and hashed in slices of that: 36 against 26 µs for an
    8k-token chat text (throwaway microbenchmark). ``start`` and ``key``: a chunk end before
    ``ends`` and the key of the prefix through it."""
    keys = []
    h = key
    if text.isascii():
        raw = memoryview(text.encode("ascii"))
        digest = xxhash.xxh3_64_intdigest
        for p in ends:
            h = digest(raw[start:p], h)
            keys.append(h)
            start = p
        return keys
    for p in ends:
        h = chain_key(h, text[start:p])
        keys.append(h)
        start = p
    return keys


def fingerprint(hf: Any) -> str:
    """What a tokenizer is, for telling whether another process's chunks were cut by the same one:
    a hash of its whole serialized form."""
    return xxhash.xxh3_64_hexdigest(hf.to_str().encode())


def batch_encoder(hf: Any) -> Callable[..., list[Any]]:
    """A ``tokenizers.Tokenizer``'s batch encode that lets go of the GIL and builds no offsets
    (``encode_batch_fast``, tokenizers >= 0.21; ``encode_batch`` before)."""
    return getattr(hf, "encode_batch_fast", None) or hf.encode_batch  # type: ignore[no-any-return]


def fast_encoder(hf: Any) -> Callable[[str, bool], list[int]]:
    """``(text, add_special_tokens) -> ids`` through ``batch_encoder``."""
    batch = batch_encoder(hf)

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = batch([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    return encode


ExtraFor = Callable[[int, int], "list[Any] | None"]  # (blocks, index of the first) -> per-block extra keys


def _memo_tag(tag: Any) -> Any:
    """What stands for ``tag`` (``CachedTokens.block_keys``: the adapter and salt, strings or None) in
    the block-key memo: ``tag`` itself while its strings are short (the usual case, no hashing), else
    a 128-bit BLAKE2b digest of its ``repr`` (exact for strings, None and tuples of them), 16 bytes
    however long the salt; bytes never equal a tuple, so the two kinds cannot meet. A strong digest,
    not xxh3: a client picks its salt, and two salts that collide would share their remembered keys."""
    parts = tag if isinstance(tag, tuple) else (tag,)
    if all(p is None or (isinstance(p, str) and len(p) <= 128) for p in parts):
        return tag
    return hashlib.blake2b(repr(tag).encode("utf-8", "surrogatepass"), digest_size=16).digest()


class CachedTokens(Sequence[int]):
    """A text's tokens as the cache assembled them: ``lead`` specials, the reused chunks, the newly
    tokenized rest, ``trail`` specials. Its length and block keys need no token list; indexing or
    iterating builds the list once."""

    __slots__ = ("_cache", "_chain", "_chunks", "_ends", "_known_key", "_lead", "_list", "_n", "_rest", "_reused",
                 "_special", "_stored_key", "_stored_len", "_text", "_trail")

    def __init__(self, cache: PrefixTokenCache, special: bool, lead: list[int], chunks: list[bytes | None],
                 reused: int, rest: list[int], trail: list[int], known_key: int | None, stored_key: int | None,
                 stored_len: int, chain: Sequence[int] = (), text: str = "", ends: Sequence[int] = ()):
        self._cache = cache
        self._special = special
        # a reused chunk is None where a note vouched for it (``PrefixTokenCache._assemble``): looked up
        # in the cache (``_chunk``) only if its tokens are asked for
        self._lead, self._chunks, self._reused, self._rest, self._trail = lead, chunks, reused, rest, trail
        self._text, self._ends = text, ends  # the text and its chunk ends, to look such a chunk up
        self._known_key = known_key    # chain hash of the last reused chunk (None: nothing reused)
        self._chain = chain            # chain hashes of this text's chunks, the reused ones first
        self._stored_key = stored_key  # chain hash of the last chunk now cached for this text
        self._stored_len = stored_len  # tokens (lead included) through that chunk
        self._n = len(lead) + reused + len(rest) + len(trail)
        self._list: list[int] | None = None

    def __len__(self) -> int:
        return self._n

    def _raw(self, i: int) -> bytes:
        """Reused chunk ``i``'s tokens as the cache holds them (bytes: the module's docstring)."""
        c = self._chunks[i]
        if c is None:
            c = self._chunks[i] = self._cache._vouched(self._chain[i], self._text, self._ends, i)
        return c

    def _chunk(self, i: int) -> array[int]:
        """Reused chunk ``i``'s tokens."""
        ids = array("I")
        ids.frombytes(self._raw(i))
        return ids

    def tolist(self) -> list[int]:
        if self._list is None:
            joined: array[int] = array("I")
            for i in range(len(self._chunks)):
                joined.frombytes(self._raw(i))
            out = list(self._lead)
            out.extend(joined.tolist())
            out.extend(self._rest)
            out.extend(self._trail)
            self._list = out
        return self._list

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self.tolist()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CachedTokens):
            other = other.tolist()
        return isinstance(other, (list, tuple)) and self.tolist() == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CachedTokens({self._n} tokens, {self._reused} reused)"

    def _from(self, start: int) -> list[int]:
        """The tokens from position ``start`` on, taking only the reused chunks that reach past it
        (``block_keys`` asks for the last partial block of the reused prefix and what follows)."""
        lead = len(self._lead)
        if self._list is not None or start < lead:
            return self.tolist()[start:]
        skip = start - lead  # into the reused part
        out: list[int] = []
        if skip < self._reused:
            need = self._reused - skip
            parts: list[array[int]] = []
            for i in range(len(self._chunks) - 1, -1, -1):
                if need <= 0:
                    break
                c = self._chunk(i)
                parts.append(c[-need:] if need < len(c) else c)
                need -= len(c)
            for part in reversed(parts):
                out.extend(part)
            skip = 0
        else:
            skip -= self._reused
        out.extend((self._rest + self._trail)[skip:])
        return out

    def block_keys(self, block_size: int, seed: int, tag: Any = None, extra_for: ExtraFor | None = None) -> list[int]:
        """``indexer.keys.block_keys`` of these tokens from ``seed``, with the keys of the reused prefix
        taken from the cache when this prefix was keyed before. ``tag`` names whatever else shapes the
        keys (adapter, salt); ``extra_for(blocks, first)`` gives the extra keys of blocks
        ``first .. first + blocks - 1`` (None for none)."""
        cache = self._cache
        memo = (block_size, seed, _memo_tag(tag), self._special)
        found: array[int] | None = None
        exact = False
        if self._known_key is not None:
            found = cache._keys_of((*memo, self._known_key))
            exact = found is not None
            if found is None:
                # the keys of an earlier prefix of this one: with workers or replicas, the turns another
                # process served come as adopted chunks, without their keys (a 32k-token prefix's
                # ~2,000 keys took ~0.5 ms to hash again)
                known = len(self._chunks)
                for j in range(known - 2, max(known - 2 - MAX_KEY_PROBES, -1), -1):
                    found = cache._keys_of((*memo, self._chain[j]))
                    if found is not None:
                        break
            if found is not None:
                cache.stats.key_hits += 1
            else:
                cache.stats.key_misses += 1
        keys = found.tolist() if found is not None else []
        first = len(keys)
        rest = self._from(first * block_size)
        keys.extend(block_keys(rest, block_size, keys[-1] if first else seed,
                               extra_for(len(rest) // block_size, first) if extra_for is not None else None))
        if self._stored_key is not None and not (exact and self._stored_key == self._known_key):
            upto = self._stored_len // block_size
            # the remembered keys as they are, then the new ones packed: packing every key again took
            # 17 of a follow-up's ~50 µs of keys at 8k tokens
            packed = found + array("Q", keys[first:upto]) if found is not None and first <= upto \
                else array("Q", keys[:upto])
            cache._remember_keys((*memo, self._stored_key), packed)
        return keys


class _Note:
    """A text's chunk ends and their chain keys through its last chunk end ``length``, told again by
    the ``NOTE_TAIL`` characters through that end (the space that starts the next chunk included)
    and the xxh3 hash of the text before it. Once the text's chunks are stored, ``tokens`` is how
    many tokens they hold (-1 until then), and ``touched`` and ``generation`` say when all of them
    were last put at the recent end of the cache's order (``PrefixTokenCache._inserted``) and in which
    life of the cache (``_generation``): ``PrefixTokenCache._vouches``."""

    __slots__ = ("digest", "ends", "generation", "keys", "length", "tail", "tokens", "touched")

    def __init__(self, length: int, tail: str, digest: int, ends: array[int], keys: array[int]):
        self.length, self.tail, self.digest = length, tail, digest
        self.ends, self.keys = ends, keys
        self.tokens = -1
        self.touched = 0
        self.generation = -1


def _prefix_digest(text: str, raw: memoryview | None, length: int) -> int:
    """xxh3 of ``text[:length]`` as UTF-8 (``raw``: the text's bytes when it is ASCII)."""
    if raw is not None:
        return xxhash.xxh3_64_intdigest(raw[:length])
    return xxhash.xxh3_64_intdigest(text[:length].encode("utf-8", "surrogatepass"))


class PrefixTokenCache:
    """``encode(text, add_special_tokens)`` as the wrapped tokenizer's, reusing known prefixes."""

    def __init__(self, hf: Any, chunk_chars: int = 256, max_tokens: int = 4_000_000, verify_every: int = 64,
                 min_chars: int = MIN_CHARS, on_mismatch: Callable[[], None] | None = None,
                 verify_share: float | None = 0.1, tiktoken: bool = True):
        self._hf = hf  # a tokenizers.Tokenizer
        self._reference = fast_encoder(hf)  # the tokenizers library's own: what the checks compare with
        self._batch = batch_encoder(hf)
        # tiktoken's BPE on the same vocabulary where it gives the same ids (indexer/fast_bpe.py)
        self._twin: Callable[[str], list[int]] | None = None
        self.twin_reason = "turned off (tokenize_tiktoken)"
        if tiktoken:
            from indexer.fast_bpe import twin

            self._twin, self.twin_reason = twin(hf)
        self._twin_calls = 0  # short texts through the twin, one in ``verify_every`` checked
        self.chunk_chars = chunk_chars
        self.max_tokens = max_tokens
        self.verify_every = verify_every
        self.verify_share = verify_share  # None: every ``verify_every``-th hit, whatever it costs
        self.min_chars = min_chars
        self.on_mismatch = on_mismatch
        self._chunks: OrderedDict[int, bytes] = OrderedDict()  # chain key -> token ids as uint32 bytes
        self._held = 0
        self._keys: OrderedDict[tuple[Any, ...], array[int]] = OrderedDict()  # see CachedTokens.block_keys
        self._keys_held = 0
        # texts' chunk ends and keys by the key of their first chunk (``_cut``), at most
        # ``max_tokens // 16`` chunk ends in all (and the latest text's, whatever its length)
        self._notes: OrderedDict[int, list[_Note]] = OrderedDict()
        self._notes_held = 0
        self._inserted = 0    # tokens stored so far, ever (the clock of ``_vouches``)
        self._generation = 0  # one more each time the chunks are thrown away together
        self._lock = threading.Lock()
        self.stats = CacheStats()
        self._specials: dict[bool, tuple[list[int], list[int]]] = {}
        self._checker: ThreadPoolExecutor | None = None
        self._checking = False  # one check at a time; hits meanwhile are not checked
        # called (from the tokenizing thread) with the chunks this process newly stored, to share them
        self.on_stored: Callable[[list[tuple[int, bytes]]], None] | None = None
        self._fingerprint: str | None = None
        self.disabled_reason = cut_problem(hf)  # None: texts may be cut at chunk ends
        self.disabled = self.disabled_reason is not None

    @property
    def twin(self) -> bool:
        """Whether texts are tokenized by tiktoken's twin of the tokenizer (``indexer/fast_bpe.py``)."""
        return self._twin is not None

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A whole text's tokens: through the twin where there is one, else the tokenizers library."""
        twin = self._twin
        if twin is None:
            return self._reference(text, add_special_tokens)
        if not add_special_tokens:
            return twin(text)
        around = self._around(True)
        if around is None:
            return self._reference(text, True)
        return [*around[0], *twin(text), *around[1]]

    def _pieces(self, pieces: list[str]) -> list[list[int]]:
        """The tokens of each piece, no special tokens added."""
        twin = self._twin
        if twin is not None:
            return [twin(p) for p in pieces]
        return [e.ids for e in self._batch(pieces, add_special_tokens=False)]

    # ---- the special tokens a post-processor puts around the body ----------------------------
    def _around(self, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
        """(leading, trailing) special ids, or None if the post-processor does something else."""
        if not add_special_tokens:
            return [], []
        if True in self._specials:
            return self._specials[True]
        probe = "hello world"
        body = self._reference(probe, False)
        full = self._reference(probe, True)
        found: tuple[list[int], list[int]] | None = None
        for i in range(len(full) - len(body) + 1):
            if full[i:i + len(body)] == body:
                found = (full[:i], full[i + len(body):])
                break
        if found is None:
            self.disabled = True
            self.disabled_reason = "its post-processor does more than add tokens around the text"
            return None
        self._specials[True] = found
        return found

    def encode(self, text: str, add_special_tokens: bool = True, seed: int = 0) -> list[int]:
        got = self.encode_cached(text, add_special_tokens, None, seed)
        return got.tolist() if isinstance(got, CachedTokens) else got

    def encode_cached(self, text: str, add_special_tokens: bool = True,
                      max_new_chars: int | None = None, seed: int = 0) -> CachedTokens | list[int]:
        """The tokens of ``text``: ``CachedTokens`` when the cache took part (no list built until one is
        asked for), else the tokenizer's list. With ``max_new_chars``, raises ``NotCached`` instead when
        more than that many characters would be tokenized (past the cached prefix; the whole text when
        it is too short for the cache or the cache is off): the router then gives it to its tokenize
        process rather than holding its event loop (router/api.py). ``seed``: where the text's chain of
        chunk keys starts (0; a salted request's ``salt_seed``), so that only texts of the same seed
        find its chunks."""
        if max_new_chars is not None and len(text) > max_new_chars and (self.disabled or len(text) < self.min_chars):
            raise NotCached
        if self.disabled or len(text) < self.min_chars:
            whole = self._encode(text, add_special_tokens)
            if self._twin is not None:
                self._twin_calls += 1
                if self.verify_every > 0 and self._twin_calls % self.verify_every == 0 and not self._checking:
                    # on the spot: a short text's check (27 µs for 40 tokens) costs the event loop less
                    # than handing it to the check thread, whose GIL handoffs stalled it (module docstring)
                    self.check(text, add_special_tokens, whole)
            return whole
        around = self._around(add_special_tokens)
        if around is None:
            if max_new_chars is not None and len(text) > max_new_chars:
                raise NotCached
            return self._encode(text, add_special_tokens)
        lead, trail = around
        tokens = self._assemble(text, add_special_tokens, lead, trail, max_new_chars, seed)
        if self._should_verify():
            self._submit_check(text, add_special_tokens, tokens)
        return tokens

    def _submit_check(self, text: str, add_special_tokens: bool, tokens: Sequence[int]) -> None:
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize-check")
        self._checking = True
        self._checker.submit(self.check, text, add_special_tokens, tokens)

    def check(self, text: str, add_special_tokens: bool, tokens: Sequence[int]) -> bool:
        """Compare ``tokens`` with the tokenizers library's whole tokenization of ``text``. On a mismatch
        the twin goes if the twin alone tokenizes the text otherwise, else the cache is turned off."""
        began = thread_time()
        try:
            whole = self._reference(text, add_special_tokens)
            self.stats.verified += 1
            self.stats.verified_tokens += len(whole)
            same = whole == (tokens.tolist() if isinstance(tokens, CachedTokens) else list(tokens))
            self.stats.verify_seconds += thread_time() - began
            if same:
                return True
            self.stats.mismatches += 1
            twin = self._twin
            if twin is not None and self._encode(text, add_special_tokens) != whole:
                self._twin = None
                self.twin_reason = "a check found tiktoken's tokens of a text differ from the tokenizer's"
                with self._lock:  # the chunks it tokenized, and their keys, may be wrong too
                    self._chunks.clear()
                    self._generation += 1  # no note vouches for what is gone
                    self._held = 0
                    self._keys.clear()
                    self._keys_held = 0
            else:
                self.disabled = True
                self.disabled_reason = "a check found a cached text's tokens differ from its whole tokenization"
            if self.on_mismatch is not None:
                self.on_mismatch()
            return False
        finally:
            self._checking = False

    def wait_checked(self, timeout: float = 10.0) -> None:
        """Wait for a check under way (tests)."""
        if self._checker is not None:
            self._checker.submit(lambda: None).result(timeout)

    def _should_verify(self) -> bool:
        st = self.stats
        return (self.verify_every > 0 and not self._checking and st.hits > 0 and st.hits % self.verify_every == 0
                and (self.verify_share is None or st.verify_seconds <= self.verify_share * st.tokenize_seconds))

    # ---- the body: cached chunks, then the rest ----------------------------------------------
    def body(self, text: str, seed: int = 0) -> list[int]:
        """The tokens of ``text`` without special tokens."""
        return self._assemble(text, False, [], [], None, seed).tolist()

    def _assemble(self, text: str, special: bool, lead: list[int], trail: list[int],
                  max_new_chars: int | None = None, seed: int = 0) -> CachedTokens:
        first = self._first_key(text, seed)
        if max_new_chars is not None and len(text) > max_new_chars and first is not None \
                and first not in self._chunks:
            # a new conversation is told by its first chunk, before the whole text is cut and hashed
            # (~0.2 ms for a cold 32k-token prompt, on the event loop: router/api.py)
            raise NotCached
        ends, keys, noted, note = self._cut_noted(text, first, seed)
        skip = head_tokens = 0
        head_touched = -1
        if noted is not None and self._vouches(noted, len(text) - noted.length):
            skip, head_tokens, head_touched = len(noted.ends), noted.tokens, noted.touched
            self.stats.vouched += 1
        with self._lock:
            # the cached chunks up to the first missing one (the cache's own arrays: never changed once
            # stored), looked up and touched in C-level loops: ~170 chunks at 8k tokens, ~80 µs in the
            # cache's big map; none of those a note vouches for (a follow-up's whole history)
            found = list(map(self._chunks.get, keys[skip:]))
            known = skip + (found.index(None) if None in found else len(found))
            deque(map(self._chunks.move_to_end, keys[skip:known]), maxlen=0)
            touched, generation = self._inserted, self._generation
        present: list[bytes] = found[:known - skip]  # type: ignore[assignment]
        chunks: list[bytes | None] = [None] * skip
        chunks += present
        reused = head_tokens + (sum(map(len, present)) >> 2)
        offset = ends[known - 1] if known else 0
        if max_new_chars is not None and len(text) - offset > max_new_chars:
            raise NotCached
        cuts = ends[known:]  # the new chunks, then the rest after the last chunk end: one batch call
        pieces = [text[a:b] for a, b in zip([offset, *cuts], [*cuts, len(text)], strict=True)]
        began = thread_time()
        ids = self._pieces(pieces)
        self.stats.tokenize_seconds += thread_time() - began
        rest: list[int] = ids[0] if len(ids) == 1 else list(chain.from_iterable(ids))
        if known:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        self.stats.reused_tokens += reused
        self.stats.tokenized_tokens += len(rest)
        new = [(key, array("I", piece).tobytes()) for key, piece in zip(keys[known:], ids)]  # the rest: no chunk
        if new:
            added = self._store(new)
            if added and self.on_stored is not None:
                self.on_stored(added)
        last = known + len(new)  # chunks of this text now in the chain
        if note is not None and last == len(keys):  # every chunk of the noted text is stored
            note.tokens = reused + (sum(len(c) for _, c in new) >> 2)
            # the vouched chunks were last touched when the note vouching for them was; the generation
            # last, so that a thread reading the note meanwhile finds it not vouching yet
            note.touched = head_touched if skip else touched
            note.generation = generation
        return CachedTokens(self, special, lead, chunks, reused, rest, trail,
                            keys[known - 1] if known else None, keys[last - 1] if last else None,
                            len(lead) + reused + len(rest) - len(ids[-1]), keys, text, ends)

    def _vouches(self, note: _Note, new_chars: int) -> bool:
        """Whether every chunk of ``note``'s text is surely still in the cache, and stays there while a
        text that holds it and ``new_chars`` characters more stores its new chunks, so that text can
        skip looking them up and touching them. When they were all last touched (or stored, in
        order), at most ``note.tokens`` tokens were put after the first of them in the cache's order;
        least recently used entries go only while more than ``max_tokens`` are held, so the first goes
        only after more than ``max_tokens - note.tokens`` tokens have been stored since, the new text's
        own among them (at most 4 a character: a token holds at least one of the UTF-8 bytes). Nothing
        else removes a chunk but clearing them all (a new ``_generation``). Another thread storing
        chunks meanwhile could still push one out before its tokens are asked for: ``_vouched``."""
        return (note.tokens >= 0 and note.generation == self._generation
                and self._inserted - note.touched + 4 * new_chars < self.max_tokens - note.tokens)

    def _vouched(self, key: int, text: str, ends: Sequence[int], i: int) -> bytes:
        """The tokens of chunk ``i`` of ``text`` (key ``key``), one a note vouched for: from the cache,
        or (should it be gone after all) tokenized again."""
        with self._lock:
            got = self._chunks.get(key)
        if got is not None:
            return got
        self.stats.vouched_missing += 1
        return array("I", self._pieces([text[ends[i - 1] if i else 0:ends[i]]])[0]).tobytes()

    def _first_key(self, text: str, seed: int = 0) -> int | None:
        """The key of ``text``'s first chunk (its chain from ``seed``), if that ends within
        ``4 * chunk_chars`` characters."""
        head = boundaries(text[:4 * self.chunk_chars], self.chunk_chars)
        return chain_key(seed, text[:head[0]]) if head else None

    def _cut(self, text: str, first: int | None, seed: int = 0) -> tuple[list[int], list[int]]:
        """``text``'s chunk ends and their chain keys (``_cut_noted``)."""
        ends, keys, _, _ = self._cut_noted(text, first, seed)
        return ends, keys

    def _cut_noted(self, text: str, first: int | None,
                   seed: int = 0) -> tuple[list[int], list[int], _Note | None, _Note | None]:
        """``text``'s chunk ends and their chain keys, the note they were taken from (None: none) and
        the note made for this text (None: none). Where an earlier text noted under the same first
        chunk (an earlier turn of its conversation) is a prefix of this one through its last chunk
        end (the ``NOTE_TAIL`` characters there equal, then the hash of all before them), its ends
        and keys are taken and only the rest is cut and hashed: the ends after a chunk end depend
        on nothing before it. For an 8k-token chat follow-up, cutting and hashing the whole text
        took 42 of the 163 µs its tokens took from the cache, and 151 of 338 µs at 32k (throwaway
        harness, medians). The text then is noted, so its next turn finds it. ``first``: ``_first_key``
        (None: the text is cut whole and not noted), from the same ``seed``: notes are kept under the
        first chunk's key, so a salted text meets only notes of its own salt."""
        cc = self.chunk_chars
        if first is None:
            ends = boundaries(text, cc)
            return ends, chain_keys(text, ends, 0, seed), None, None
        with self._lock:
            notes = self._notes.get(first)
            seen = list(notes) if notes else []
        raw = memoryview(text.encode("ascii")) if text.isascii() else None
        n = len(text)
        found = None
        for note in seen:
            at = note.length + 1 - len(note.tail)
            if note.length < n and text.startswith(note.tail, at) \
                    and _prefix_digest(text, raw, note.length) == note.digest:
                found = note
                break
        if found is None:
            ends = boundaries(text, cc)
            keys = chain_keys(text, ends, 0, seed)
            noted_ends, noted_keys = array("Q", ends), array("Q", keys)
        else:
            at = found.length
            more = boundaries(text, cc, at)
            if not more:  # nothing past the note: it is this text's note
                return found.ends.tolist(), found.keys.tolist(), found, None
            added = chain_keys(text[at:], [p - at for p in more], 0, found.keys[-1])  # the new part alone
            # the note's arrays as they are, then the new part packed (not every end and key again)
            noted_ends, noted_keys = found.ends + array("Q", more), found.keys + array("Q", added)
            ends, keys = found.ends.tolist() + more, found.keys.tolist() + added
        last = ends[-1]
        note = _Note(last, text[max(0, last + 1 - NOTE_TAIL):last + 1], _prefix_digest(text, raw, last),
                     noted_ends, noted_keys)
        self._note(first, note, found)
        return ends, keys, found, note

    def _note(self, first: int, note: _Note, replaces: _Note | None) -> None:
        """Keep ``note`` first among those of its first chunk (in place of the note it extends)."""
        cap = max(1, self.max_tokens // 16)
        with self._lock:
            notes = self._notes.get(first)
            if notes is None:
                notes = self._notes[first] = []
            else:
                self._notes.move_to_end(first)
            if replaces is not None and replaces in notes:
                notes.remove(replaces)
                self._notes_held -= len(replaces.ends)
            notes.insert(0, note)
            self._notes_held += len(note.ends)
            while len(notes) > NOTES_PER_HEAD:
                self._notes_held -= len(notes.pop().ends)
            while self._notes_held > cap:  # the least recently used first chunks' notes go, then this one's older
                oldest = next(iter(self._notes))
                if oldest != first:
                    self._notes_held -= sum(len(g.ends) for g in self._notes.pop(oldest))
                elif len(notes) > 1:
                    self._notes_held -= len(notes.pop().ends)
                else:
                    break  # the new note alone: kept, whatever its length

    def _store(self, chunks: Iterable[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Put chunks in (least recently used out past ``max_tokens``); those that were not there. One
        that was is touched (a text's chunk after one that had gone, tokenized again: its note vouches
        for all of them as of now)."""
        added = []
        with self._lock:
            for key, chunk in chunks:
                if key in self._chunks:
                    self._chunks.move_to_end(key)
                    continue
                self._chunks[key] = chunk
                n = len(chunk) >> 2
                self._held += n
                self._inserted += n
                added.append((key, chunk))
            while self._held > self.max_tokens and self._chunks:
                _, old = self._chunks.popitem(last=False)
                self._held -= len(old) >> 2
        return added

    # ---- chunks from other processes -------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """``fingerprint`` of the wrapped tokenizer (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self._hf)
        return self._fingerprint

    def adopt(self, chunks: Iterable[tuple[int, bytes]]) -> int:
        """Take chunks another process of the same tokenizer stored (the booking bus carries them:
        ``router/bookbus.py``); returns how many were new here. They are not passed on again."""
        added = self._store(chunks)
        self.stats.adopted += len(added)
        return len(added)

    def _keys_of(self, memo: tuple[Any, ...]) -> array[int] | None:
        """The keys remembered under ``memo`` (the cache's own array: not to be changed), or None."""
        with self._lock:
            got = self._keys.get(memo)
            if got is None or not got:
                return None
            self._keys.move_to_end(memo)
        return got

    def _remember_keys(self, memo: tuple[Any, ...], packed: array[int]) -> None:
        """Remember ``packed`` under ``memo`` (least recently used out past ``max_tokens // 4`` keys).
        ``memo``'s parts are of fixed size (``_memo_tag``): the bound counts the keys alone."""
        if not packed:
            return
        with self._lock:
            if memo in self._keys:
                return
            self._keys[memo] = packed
            self._keys_held += len(packed)
            while self._keys_held > self.max_tokens // 4 and self._keys:
                _, old = self._keys.popitem(last=False)
                self._keys_held -= len(old)

    @property
    def held_tokens(self) -> int:
        return self._held

    def key_hit_rate(self) -> float:
        """Share of texts with a reused prefix whose block keys were remembered too."""
        total = self.stats.key_hits + self.stats.key_misses
        return self.stats.key_hits / total if total else 0.0

    def hit_rate(self) -> float:
        """Share of the tokens of cacheable texts that came from the cache."""
        total = self.stats.reused_tokens + self.stats.tokenized_tokens
        return self.stats.reused_tokens / total if total else 0.0
