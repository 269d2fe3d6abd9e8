"""The booking bus: router processes share their ledger bookings over ZeroMQ PUB/SUB.

Every router process (a worker of one ``kvroute serve --workers N``, or a router replica) has an
*origin* id, new at every start (host, pid and random bits), so a restarted process never speaks
for its former self. It publishes each local book and release (``Ledger.on_change``) and applies
every other origin's into its own ledger as foreign bookings, so ``inflight``, ``queued_tokens``
and ``kv_booked`` count the whole fleet of routers' work within milliseconds.

Wire format: two frames, ``[TOPIC, msgpack([VERSION, kind, origin, seq, body])]``; ``seq`` counts
the origin's messages from 1.

- ``"b"`` book:     body ``[pod, ticket, tokens, resource]`` (resource ``"p"`` prefill, ``"k"`` KV room)
- ``"r"`` release:  body ``[pod, ticket, resource]``
- ``"s"`` snapshot: body ``[[pod, ticket, tokens, resource], ...]``, the origin's open bookings
- ``"t"`` tokens:   body ``[fingerprint, [[key, ids], ...]]``: chunks of text this origin tokenized
  (``indexer/prefix_tokens.py``: a prefix's chain key and its chunk's token ids as little-endian
  uint32 bytes), so a follow-up that lands on another worker or replica reuses them rather than
  tokenizing the whole conversation again; taken only where ``fingerprint`` (the tokenizer's) is
  the receiver's own; at most ``TOKENS_PER_MESSAGE`` tokens per message (a big prompt's go as several)
- ``"c"`` credits:  body ``[key space, [[pod, n], ...], keys]``: prompts this origin routed, each as
  the pod it credited them to (``Router.book``: the pod will hold their blocks) and its number of
  block keys, and all of their keys, in that order, as one string of little-endian uint64s; so a
  sibling or a follow-up that lands on another worker or replica finds them. Taken only where
  ``key space`` (``indexer.keys.key_space``: the block size and a probe key) is the receiver's own;
  at most ``CREDIT_KEYS_PER_MESSAGE`` keys per message
- ``"w"`` withdrawals: body as credits': credits this origin took back (``Router.withdraw``: the pod
  did not take the request they were made for, so it holds none of those blocks); each receiver
  takes back the same credit (``Router.withdraw_foreign``), never what a pod's events stored.
  Queued with the credits, in order: a flush sends each run of credits or of withdrawals as its
  messages, so a credit, its withdrawal and a new credit of the same keys arrive as they were made
- ``"l"`` limits:   body ``[[caller, requests, prompt tokens], ...]``: what this origin charged each
  caller's rate-limit buckets since its last message (``router/auth.py``: a key's *name*, or
  ``anonymous``), net of what it gave back; each receiver charges its own buckets of that caller the
  same (into debt if need be), so a key's limits hold across workers and replicas instead of each
  process granting them in full. At most ``SPENT_PER_MESSAGE`` callers per message
- ``"m"`` several:  body ``[["b", pod, ticket, tokens, resource] | ["r", pod, ticket, resource], ...]``,
  applied in order: the books and releases queued since the last message go out together (a lone
  one goes as ``"b"``/``"r"``; at most ``MAX_OPS`` per message). A booking booked and released
  since the last message goes with neither: a peer would apply the two in one go, to no effect

**When changes go out.** At the end of the event-loop turn that made them, unless a message went
less than ``min_interval_s`` ago: then at that interval's end, with whatever else was queued by
then. A quiet router's bookings thus leave at once, and a busy one sends at most one message per
interval. Each flush costs far more than its bytes: on a 2-core machine about 0.3 ms of CPU over
every process it crosses (the sender's and receivers' ZeroMQ I/O threads, the forwarder's threads,
the wake-ups), so under 32 connections of small requests the bus took a fifth of two workers'
throughput when every loop turn sent one (docs/router.md, "The booking bus's cost"). The messages
of one flush (changes, credits, chunks) leave together and are read in one wake-up: sending a
flush's credits inside its "m" message instead gained nothing (docs/router.md, "Where the rest of
the booking bus's cost sits"), and a longer interval, which did, made the peers' view stale
enough to route worse than no bus at all.

PUB/SUB loses messages (a slow joiner, a reconnect, a full high-water mark), so every origin also
publishes its full snapshot every ``booking_bus_snapshot_s``; a snapshot *replaces* what the others
hold for that origin, repairing whatever was lost, and doubles as the heartbeat. An origin silent
for ``booking_bus_peer_timeout_s`` has its bookings dropped (a replica that dies takes its bookings
with it); later book and release messages from it are ignored until a snapshot from it (it was cut
off, not dead) brings it back with exactly its open bookings. A message older than one already applied from the
same origin (a duplicate through a second path) is skipped; a gap in ``seq`` is counted as lost.

Every buffer is bounded: ZeroMQ's high-water marks, the largest frame accepted, bookings held per
origin and origins tracked; whatever does not fit, and every frame that does not decode, is counted
in ``kvroute_booking_bus_messages_total{kind, direction="dropped"}`` and dropped, never raised.

**Who may speak on it.** Without a key the bus trusts its network: whoever reaches a replica's bus
port reads its bookings (the fleet's pods and their load), and whatever a replica subscribes to (a
static peer, or an address the peers' DNS name resolves to) writes bookings into its ledger; an
inflated queue steers traffic away from a pod. With ``booking_bus_curve_secret_key`` (one CURVE key
pair, a Kubernetes Secret shared by every router process) every socket of the bus speaks CURVE:
the sockets that bind are CURVE servers with the pair, the sockets that connect are CURVE clients
with the same pair, and a ZAP handler in each process that binds admits only clients presenting
its public key. So a SUB takes messages only from a publisher that holds the secret key (the
handshake proves the server's key), a bound socket serves only peers that hold it, and the traffic
is encrypted. ``BusKey`` holds the pair.

Topologies (``router/serve.py`` and ``router/service.py`` wire them):

- workers of one ``kvroute serve``: each worker's PUB binds an IPC socket named by its pid in a
  directory the parent made for them (``siblings_directory``: private to the user, removed at
  exit), and its SUB connects to the others' sockets there, looked for every
  ``SIBLINGS_INTERVAL_S`` (a restarted worker is found within that; a dead one's is skipped).
  Each message goes straight to the other workers. Until 2026-12-05 it went through a
  ``Forwarder`` in the parent (XSUB/XPUB on 127.0.0.1), which cost two more processes' wake-ups
  a flush and sent every worker its own messages back: two workers now serve 6,893 against 6,593
  small chat req/s under 32 connections (five alternating pairs; docs/router.md, "Where the rest
  of the booking bus's cost sits"). And without a CURVE key the forwarder's loopback ports took
  any local user's bookings, where the directory takes only this user's;
- replicas: each process binds its PUB at ``booking_bus_bind`` and its SUB connects to every peer
  (``booking_bus_peers``, and the addresses of ``booking_bus_peers_dns`` re-resolved); its own
  endpoint among them is harmless (its own messages are recognised and skipped);
- both: the parent runs the ``Forwarder``: each worker's PUB connects to its XSUB, each worker's
  SUB to its XPUB, which also binds ``booking_bus_bind`` for the replicas; workers connect to the
  remote peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
import tempfile
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import msgspec
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.booking import KV, PREFILL, Ledger

log = logging.getLogger("kvroute.bookbus")

TOPIC = b"kvroute.bookings"
VERSION = 1
_RES = {PREFILL: "p", KV: "k"}
_RES_BACK = {"p": PREFILL, "k": KV}
MAX_FORGOTTEN = 1024
RECV_BATCH = 256  # messages handled per event-loop turn before yielding ...
RECV_BYTES = 256 * 1024  # ... or bytes of them: 256 full "m" messages (4,096 changes each) took 6.65 s
MAX_OPS = 4096   # books and releases in one "m" message (more wait for the next one)
TOKENS_PER_MESSAGE = 8192  # token ids in one "t" message (about 33 KB, less than a full "m" message)
MAX_PENDING_TOKENS = 32 * TOKENS_PER_MESSAGE  # token ids queued for the next flush (1 MiB)
CREDIT_KEYS_PER_MESSAGE = 16_384  # block keys in one "c" message (128 KB: a 262k-token prompt)
MAX_PENDING_CREDIT_KEYS = 8 * CREDIT_KEYS_PER_MESSAGE  # block keys queued for the next flush (1 MiB)
SPENT_PER_MESSAGE = 1024  # callers in one "l" message
MAX_PENDING_SPENT = 8 * SPENT_PER_MESSAGE  # callers with charges queued for the next flush
MAX_CALLER_NAME = 256
_BIG_ENDIAN = sys.byteorder == "big"
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class BusKey:
    """The bus's CURVE key pair (Z85 bytes), the same in every router process."""

    public: bytes
    secret: bytes

    @classmethod
    def from_secret(cls, secret_z85: str) -> BusKey:
        """The pair from its secret key (40 Z85 characters); ValueError if it is not one."""
        secret = secret_z85.strip().encode("ascii", errors="replace")
        if len(secret) != 40:
            raise ValueError("a CURVE secret key is 40 Z85 characters")
        try:
            return cls(zmq.curve_public(secret), secret)
        except (zmq.ZMQError, ValueError) as exc:
            raise ValueError(f"not a CURVE secret key in Z85: {exc}") from None

    @classmethod
    def of(cls, settings: Any) -> BusKey | None:
        """The pair of a router's ``booking_bus_curve_secret_key``, or None when it has none."""
        secret = settings.booking_bus_curve_secret_key
        return cls.from_secret(secret) if secret else None

    def serve(self, sock: Any) -> None:
        """A socket that binds: a CURVE server with the pair."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def dial(self, sock: Any) -> None:
        """A socket that connects: a CURVE client with the pair, expecting a server with it."""
        sock.curve_serverkey = self.public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def guard(self, ctx: zmq.Context) -> Any:
        """Start a ZAP handler in ``ctx`` that admits only clients presenting this public key (the
        sockets of ``ctx`` that bind would admit any key otherwise); stop it with ``.stop()``."""
        from zmq.auth.thread import ThreadAuthenticator

        key = self.public

        class _OnlyOurs:
            def callback(self, domain: str, client_key: bytes) -> bool:
                return bool(client_key == key)

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvroute.bookbus.zap"))
        auth.start()
        auth.configure_curve_callback("*", _OnlyOurs())
        return auth


def new_origin() -> str:
    """A fresh origin id: host, pid and 32 random bits (a restart never reuses one)."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"


def encode(kind: str, origin: str, seq: int, body: Any) -> list[bytes]:
    return [TOPIC, _encoder.encode([VERSION, kind, origin, seq, body])]


class BadFrame(ValueError):
    """A message that does not decode or does not have the expected shape."""


def _booking(item: Any) -> tuple[str, int, float, str]:
    if not (isinstance(item, list) and len(item) == 4):
        raise BadFrame("booking is not [pod, ticket, tokens, resource]")
    pod, ticket, tokens, res = item
    if not (isinstance(pod, str) and isinstance(ticket, int) and not isinstance(ticket, bool)
            and isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and res in _RES_BACK):
        raise BadFrame("booking has a field of the wrong type")
    if not (0 <= tokens < 1e12):
        raise BadFrame("booking tokens out of range")
    return pod, ticket, float(tokens), _RES_BACK[res]


def decode(frames: list[bytes], max_snapshot: int | None = None) -> tuple[str, str, int, Any]:
    """(kind, origin, seq, body) of a message with its body checked; BadFrame otherwise. A snapshot's
    body is (its first ``max_snapshot`` bookings, how many it listed): the rest could not be held
    anyway, so they are not checked either (a frame of 800,000, 7.5 MiB, held the loop 1.4 s)."""
    if len(frames) != 2 or frames[0] != TOPIC:
        raise BadFrame("not [topic, payload]")
    try:
        msg = _decoder.decode(frames[1])
    except (msgspec.DecodeError, ValueError) as exc:
        raise BadFrame(f"payload does not decode: {exc}") from None
    if not (isinstance(msg, list) and len(msg) == 5):
        raise BadFrame("payload is not [version, kind, origin, seq, body]")
    version, kind, origin, seq, body = msg
    if version != VERSION:
        raise BadFrame(f"version {version!r}")
    if not (isinstance(origin, str) and 0 < len(origin) <= 128 and isinstance(seq, int) and seq > 0):
        raise BadFrame("bad origin or seq")
    if kind == "b":
        return kind, origin, seq, _booking(body)
    if kind == "r":
        return kind, origin, seq, _release(body)
    if kind == "s":
        if not isinstance(body, list):
            raise BadFrame("snapshot is not a list")
        held = body if max_snapshot is None else body[:max_snapshot]
        return kind, origin, seq, ([_booking(b) for b in held], len(body))
    if kind == "t":
        return kind, origin, seq, _tokens(body)
    if kind == "c" or kind == "w":
        return kind, origin, seq, _credits(body)
    if kind == "l":
        return kind, origin, seq, _spent(body)
    if kind == "m":
        if not (isinstance(body, list) and 0 < len(body) <= MAX_OPS):
            raise BadFrame(f"several is not a list of 1 to {MAX_OPS} changes")
        return kind, origin, seq, [_change(op) for op in body]
    raise BadFrame(f"unknown kind {kind!r}")


def _release(body: Any) -> tuple[str, int, str]:
    if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], str)
            and isinstance(body[1], int) and not isinstance(body[1], bool) and body[2] in _RES_BACK):
        raise BadFrame("release is not [pod, ticket, resource]")
    return body[0], body[1], _RES_BACK[body[2]]


def _native_order(ids: bytes) -> bytes:
    """uint32 token ids byte-swapped: the wire's little-endian to a big-endian host's order and back."""
    swapped = array("I")
    swapped.frombytes(ids)
    swapped.byteswap()
    return swapped.tobytes()


def _tokens(body: Any) -> tuple[str, list[tuple[int, bytes]]]:
    """A "t" message's (fingerprint, [(chain key, token ids)])."""
    if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], str) and 0 < len(body[0]) <= 64
            and isinstance(body[1], list) and 0 < len(body[1]) <= TOKENS_PER_MESSAGE):
        raise BadFrame("tokens is not [fingerprint, [[key, ids], ...]]")
    chunks = []
    total = 0
    for item in body[1]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                and not isinstance(item[0], bool) and item[0] >= 0 and isinstance(item[1], bytes)
                and item[1] and len(item[1]) % 4 == 0):
            raise BadFrame("a chunk is not [key, uint32 ids]")
        ids = _native_order(item[1]) if _BIG_ENDIAN else item[1]  # little-endian on the wire
        total += len(ids) >> 2
        chunks.append((item[0], ids))
    if total > TOKENS_PER_MESSAGE:
        raise BadFrame(f"more than {TOKENS_PER_MESSAGE} tokens in one message")
    return body[0], chunks


def _credits(body: Any) -> tuple[str, list[tuple[str, list[int]]]]:
    """A "c" (or "w") message's (key space, [(pod, block keys)])."""
    if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], str) and 0 < len(body[0]) <= 64
            and isinstance(body[1], list) and 0 < len(body[1]) <= CREDIT_KEYS_PER_MESSAGE
            and isinstance(body[2], bytes) and len(body[2]) % 8 == 0
            and len(body[2]) <= 8 * CREDIT_KEYS_PER_MESSAGE):
        raise BadFrame("credits is not [key space, [[pod, n], ...], uint64 keys]")
    keys = array("Q")
    keys.frombytes(body[2])
    if _BIG_ENDIAN:  # little-endian on the wire
        keys.byteswap()
    every = keys.tolist()
    credits = []
    at = 0
    for item in body[1]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and 0 < len(item[0]) <= 256
                and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] > 0):
            raise BadFrame("a credit is not [pod, number of keys]")
        credits.append((item[0], every[at:at + item[1]]))
        at += item[1]
    if at != len(every):
        raise BadFrame("the credits' numbers of keys do not add up to the keys sent")
    return body[0], credits


def _spent(body: Any) -> list[tuple[str, float, float]]:
    """A "l" message's [(caller, requests, prompt tokens)]: finite, less than 1e12 either way."""
    if not (isinstance(body, list) and 0 < len(body) <= SPENT_PER_MESSAGE):
        raise BadFrame(f"limits is not a list of 1 to {SPENT_PER_MESSAGE} charges")
    out = []
    for item in body:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and 0 < len(item[0]) <= MAX_CALLER_NAME):
            raise BadFrame("a charge is not [caller, requests, prompt tokens]")
        name, requests, tokens = item
        for v in (requests, tokens):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -1e12 < v < 1e12:
                raise BadFrame("a charge is not a finite number under 1e12")
        out.append((name, float(requests), float(tokens)))
    return out


def _change(op: Any) -> tuple[str, tuple]:
    """One change of an "m" message: ("b", booking) or ("r", release)."""
    if isinstance(op, list) and op and op[0] == "b":
        return "b", _booking(op[1:])
    if isinstance(op, list) and op and op[0] == "r":
        return "r", _release(op[1:])
    raise BadFrame("a change is neither ['b', ...] nor ['r', ...]")


KINDS = {"b": "book", "r": "release", "s": "snapshot", "m": "batch", "t": "tokens", "c": "credits",
         "w": "withdrawals", "l": "limits"}


@dataclass
class BusStats:
    """Counters of one bus: messages by (kind, direction), peers, timeouts, snapshot repairs."""

    messages: dict[tuple[str, str], int] = field(default_factory=dict)
    peer_timeouts: int = 0
    repaired: int = 0  # bookings a snapshot added or released (their message was lost)
    last_latency_s: float | None = None
    # a tokenize thread counts the chunks it drops while the loop counts others of the same key
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, kind: str, direction: str, n: int = 1) -> None:
        key = (kind, direction)
        with self._lock:
            self.messages[key] = self.messages.get(key, 0) + n

    def get(self, kind: str, direction: str) -> int:
        return self.messages.get((kind, direction), 0)


@dataclass
class _Peer:
    last_seen: float
    seq: int = 0


SIBLINGS_INTERVAL_S = 0.2  # how often a worker looks for its siblings' sockets


def bus_replicas(settings: Any) -> bool:
    """Whether a router's settings (``RouterSettings``) name other replicas to share bookings with:
    a bind or peers. Its workers then go through the ``Forwarder``, else straight to each other."""
    return bool(settings.booking_bus_bind or settings.booking_bus_peers or settings.booking_bus_peers_dns)


def siblings_directory() -> str:
    """A new directory, private to this user, for the IPC sockets of one ``kvroute serve``'s workers.
    Under the temporary directory unless its path leaves too little of a socket path's 107 bytes."""
    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="kvroute-bus-", dir=base if len(base) <= 64 else "/tmp")


def sibling_endpoint(directory: str, pid: int | None = None) -> str:
    """The endpoint this process (or ``pid``) binds in ``directory``."""
    return f"ipc://{directory}/{os.getpid() if pid is None else pid}"


def sibling_endpoints(directory: str, own: str) -> list[str]:
    """The endpoints of the other live workers in ``directory``: every socket named by the pid of a
    process that exists, ``own`` left out."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        endpoint = sibling_endpoint(directory, int(name)) if name.isdigit() else own
        if endpoint == own:
            continue
        try:
            os.kill(int(name), 0)
        except ProcessLookupError:  # a worker that died without removing its socket
            continue
        except PermissionError:
            pass
        found.append(endpoint)
    return sorted(found)


class BookingBus:
    """One process's end of the bus, bound to its ``Ledger`` (``start`` installs ``on_change``)."""

    def __init__(self, ledger: Ledger, *, pub_bind: Iterable[str] = (), pub_connect: Iterable[str] = (),
                 sub_connect: Iterable[str] = (), resolve_peers: Callable[[], Awaitable[list[str]]] | None = None,
                 resolve_interval_s: float = 5.0, snapshot_s: float = 0.5, peer_timeout_s: float = 3.0,
                 hwm: int = 10_000, max_bookings_per_origin: int = 50_000, max_origins: int = 256,
                 max_frame_bytes: int = 8 * 1024 * 1024, origin: str | None = None,
                 clock: Callable[[], float] = time.monotonic, key: BusKey | None = None,
                 min_interval_s: float = 0.0, siblings: Callable[[], list[str]] | None = None):
        """``key``: CURVE on every socket (the module's docstring says who may then speak);
        ``min_interval_s``: the least time between two messages of books and releases; ``siblings``:
        the other workers' endpoints, asked for every ``SIBLINGS_INTERVAL_S``."""
        if key is not None and pub_bind and pub_connect:
            raise ValueError("with a CURVE key the PUB socket either binds (a server) or connects (a client)")
        self.ledger = ledger
        self.key = key
        self._auth: Any = None
        self.origin = origin or new_origin()
        self._own = _encoder.encode(self.origin)  # the origin as it appears in our own messages
        self.pub_bind, self.pub_connect = list(pub_bind), list(pub_connect)
        self.static_peers = list(sub_connect)
        self.resolve_peers = resolve_peers
        self.resolve_interval_s = resolve_interval_s
        self.siblings = siblings
        self._resolved: list[str] = []  # what ``resolve_peers`` last answered
        self.snapshot_s = snapshot_s
        self.peer_timeout_s = peer_timeout_s
        self.hwm = hwm
        self.max_bookings_per_origin = max_bookings_per_origin
        self.max_origins = max_origins
        self.max_frame_bytes = max_frame_bytes
        self.clock = clock
        self.stats = BusStats()
        self.peers: dict[str, _Peer] = {}
        self.forgotten: OrderedDict[str, None] = OrderedDict()
        self.connected: set[str] = set()
        self.bound: list[str] = []  # the endpoints really bound (a port 0 resolved)
        self._seq = 0
        self._pending: list[list[Any] | None] = []   # books and releases not yet sent (None: coalesced)
        # the tickets of the books in ``_pending`` -> their place there: a book released before the
        # next message is taken out of it with its release (``_coalesced`` pairs so far), since a peer
        # would apply both in one go; the ledger's tickets are unique across prefill and KV bookings
        self._unsent: dict[int, int] = {}
        self._coalesced = 0
        # chunks not yet sent (``share_tokens``, from any thread): (fingerprint, chunks), at most
        # ``MAX_PENDING_TOKENS`` token ids in all; ``_tokens_wake``: a flush is asked for already
        self._pending_tokens: list[tuple[str, list[tuple[int, bytes]]]] = []
        self._pending_token_count = 0
        self._tokens_wake = False
        self._tokens_lock = threading.Lock()
        # credits and withdrawals not yet sent (``share_credit``, ``share_withdrawal``, on the loop), in
        # order: (kind "c" or "w", pod, keys), at most ``MAX_PENDING_CREDIT_KEYS`` keys of each kind in all
        self._pending_credits: list[tuple[str, str, list[int]]] = []
        self._pending_credit_keys = 0
        self._pending_withdrawn_keys = 0
        # rate-limit charges not yet sent (``share_spent``, on the loop): caller -> [requests, tokens]
        self._pending_spent: dict[str, list[float]] = {}
        self._loop_thread: int | None = None
        self._flush_handle: asyncio.Handle | None = None
        self.min_interval_s = min_interval_s
        self._flushed_at = -float("inf")  # the loop's time of the last message of changes
        self._loop: asyncio.AbstractEventLoop | None = None
        # another origin's tokenized chunks: (fingerprint, chunks) -> taken (False: another tokenizer)
        self.on_tokens: Callable[[str, list[tuple[int, bytes]]], bool] | None = None
        # another origin's credit of a prompt's block keys to a pod, taken where its key space is ours
        self.on_credits: Callable[[str, list[int]], None] | None = None
        # another origin's withdrawal of such a credit (``Router.withdraw_foreign``), likewise
        self.on_withdrawals: Callable[[str, list[int]], None] | None = None
        # another origin's charges to a caller's rate-limit buckets (``Gate.charge_foreign``)
        self.on_spent: Callable[[str, float, float], None] | None = None
        self.key_space = ""
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._sub: zmq.Socket | None = None
        self._fd: Any = None
        self._tasks: list[asyncio.Task] = []

    # ---- sending ---------------------------------------------------------------------------
    def _send(self, kind: str, body: Any) -> None:
        if self._pub is None:
            return
        self._seq += 1
        try:
            self._pub.send_multipart(encode(kind, self.origin, self._seq, body), flags=zmq.NOBLOCK)
            self.stats.count(KINDS[kind], "sent")
        except zmq.ZMQError:  # PUB drops at its high-water mark by itself; anything else: count, go on
            self.stats.count(KINDS[kind], "send_failed")

    def on_change(self, event: str, pod: str, ticket: int, tokens: float, resource: str) -> None:
        """A local book or release: queued, and sent at the end of this loop turn, or at the end of
        ``min_interval_s`` after the last message if that is later (the module's docstring)."""
        if self._pub is None:
            return
        if event == "book":
            self._unsent[ticket] = len(self._pending)
            self._pending.append(["b", pod, ticket, tokens, _RES[resource]])
        else:
            at = self._unsent.pop(ticket, None)
            if at is not None:  # booked and released since the last message: the others need neither
                self._pending[at] = None
                self._coalesced += 1
                return
            self._pending.append(["r", pod, ticket, _RES[resource]])
        if len(self._pending) >= MAX_OPS:
            self.flush()
        else:
            self._flush_soon()

    def _flush_soon(self) -> None:
        """``_flush_later`` on the event loop; without a running loop (a synchronous caller), flush now."""
        if self._flush_handle is not None:
            return  # a flush is asked for already (so there is a loop): it takes this change too
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_later()

    def _flush_later(self) -> None:
        """On the loop: ask for a flush at the end of this turn, or at the end of ``min_interval_s``
        after the last message if that is later (nothing if one is asked for already)."""
        if self._flush_handle is None:
            loop = asyncio.get_running_loop()
            wait = self._flushed_at + self.min_interval_s - loop.time()
            self._flush_handle = loop.call_soon(self.flush) if wait <= 0 else loop.call_later(wait, self.flush)

    def flush(self) -> None:
        """Send the queued changes (one as its own message, several as one "m" message), then the
        queued chunks ("t" messages of at most ``TOKENS_PER_MESSAGE`` token ids each)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        pending, self._pending = self._pending, []
        ops = [op for op in pending if op is not None]
        if self._unsent:
            self._unsent = {}
        if self._coalesced:
            self.stats.count("book", "coalesced", self._coalesced)
            self.stats.count("release", "coalesced", self._coalesced)
            self._coalesced = 0
        credits, self._pending_credits = self._pending_credits, []
        self._pending_credit_keys = self._pending_withdrawn_keys = 0
        spent = self._pending_spent
        if spent:
            self._pending_spent = {}
        with self._tokens_lock:
            shared, self._pending_tokens = self._pending_tokens, []
            self._pending_token_count = 0
            self._tokens_wake = False
        if (ops or shared or credits or spent) and self._loop is not None and not self._loop.is_closed():
            self._flushed_at = self._loop.time()
        if len(ops) == 1:
            op = ops[0]
            self._send(op[0], op[1:])
        elif ops:
            self._send("m", ops)
            books = sum(1 for op in ops if op[0] == "b")
            if books:
                self.stats.count("book", "sent", books)
            if books < len(ops):
                self.stats.count("release", "sent", len(ops) - books)
        by_fingerprint: dict[str, list[tuple[int, bytes]]] = {}
        for fingerprint, chunks in shared:
            by_fingerprint.setdefault(fingerprint, []).extend(chunks)
        for fingerprint, chunks in by_fingerprint.items():
            batch: list[list[Any]] = []
            n = 0
            for key, ids in chunks:
                count = len(ids) >> 2
                if n + count > TOKENS_PER_MESSAGE:
                    self._send("t", [fingerprint, batch])
                    batch, n = [], 0
                batch.append([key, _native_order(ids) if _BIG_ENDIAN else ids])
                n += count
            if batch:
                self._send("t", [fingerprint, batch])
        if credits:
            self._send_credits(credits)
        if spent:
            charges = [[name, v[0], v[1]] for name, v in spent.items()]
            for at in range(0, len(charges), SPENT_PER_MESSAGE):
                self._send("l", charges[at:at + SPENT_PER_MESSAGE])

    def _send_credits(self, credits: list[tuple[str, str, list[int]]]) -> None:
        """The queued credits and withdrawals, in their order: each run of one kind as "c" (or "w")
        messages of at most ``CREDIT_KEYS_PER_MESSAGE`` keys, a list of (pod, number of keys) and one
        string of all the keys, converted in one pass each."""
        start = 0
        while start < len(credits):
            kind = credits[start][0]
            end, n = start, 0
            while end < len(credits) and credits[end][0] == kind \
                    and n + len(credits[end][2]) <= CREDIT_KEYS_PER_MESSAGE:
                n += len(credits[end][2])
                end += 1
            part = credits[start:end]
            keys = array("Q", chain.from_iterable(k for _, _, k in part))
            if _BIG_ENDIAN:
                keys.byteswap()
            self._send(kind, [self.key_space, [[pod, len(k)] for _, pod, k in part], keys.tobytes()])
            start = end

    def share_credit(self, pod: str, keys: list[int]) -> None:
        """Publish that this process credited a routed prompt's block ``keys`` to ``pod`` (on the event
        loop, from ``Router.book``; ``keys`` is kept, not copied, until the flush: a plan's keys are
        never changed). Queued, they leave with the next flush of books and releases; a prompt of
        more than ``CREDIT_KEYS_PER_MESSAGE`` blocks sends its first ones (a prefix of a chain is a
        chain). Past ``MAX_PENDING_CREDIT_KEYS`` queued, a credit is dropped and counted
        (``kind="credits", direction="dropped"``): a peer then routes that prompt's siblings without it."""
        if self._pub is None or not keys:
            return
        if len(keys) > CREDIT_KEYS_PER_MESSAGE:
            keys = keys[:CREDIT_KEYS_PER_MESSAGE]
        if self._pending_credit_keys + len(keys) > MAX_PENDING_CREDIT_KEYS:
            self.stats.count("credits", "dropped")
            return
        self._pending_credits.append(("c", pod, keys))
        self._pending_credit_keys += len(keys)
        if self._flush_handle is None:  # the booking before it asked for one already, as a rule
            self._flush_soon()

    def share_withdrawal(self, pod: str, keys: list[int]) -> None:
        """Publish that this process took back its credit of block ``keys`` on ``pod`` (on the event
        loop, from ``Router.withdraw``: the pod did not take the request), so the other processes
        take back the copy ``share_credit`` gave them. Queued after the credits before it and sent
        with them, in order, at the next flush; a withdrawal of more than ``CREDIT_KEYS_PER_MESSAGE``
        keys sends its first ones (the credit it takes back sent no more). Past
        ``MAX_PENDING_CREDIT_KEYS`` withdrawn keys queued, a withdrawal is dropped and counted
        (``kind="withdrawals", direction="dropped"``): a peer then keeps that credit until its TTL."""
        if self._pub is None or not keys:
            return
        if len(keys) > CREDIT_KEYS_PER_MESSAGE:
            keys = keys[:CREDIT_KEYS_PER_MESSAGE]
        if self._pending_withdrawn_keys + len(keys) > MAX_PENDING_CREDIT_KEYS:
            self.stats.count("withdrawals", "dropped")
            return
        self._pending_credits.append(("w", pod, keys))
        self._pending_withdrawn_keys += len(keys)
        if self._flush_handle is None:
            self._flush_soon()

    def share_spent(self, caller: str, requests: float, tokens: float) -> None:
        """Publish a charge this process made to ``caller``'s rate-limit buckets (on the event loop,
        from ``Gate``): summed per caller until the next flush, which leaves with the next books and
        releases (or, for a request refused before it was booked, at the end of this loop turn or
        interval). Past ``MAX_PENDING_SPENT`` callers queued, a new caller's charge is dropped and
        counted (``kind="limits", direction="dropped"``): the peers then grant that much more."""
        if self._pub is None:
            return
        got = self._pending_spent.get(caller)
        if got is None:
            if len(self._pending_spent) >= MAX_PENDING_SPENT or not 0 < len(caller) <= MAX_CALLER_NAME:
                self.stats.count("limits", "dropped")
                return
            self._pending_spent[caller] = [requests, tokens]
        else:
            got[0] += requests
            got[1] += tokens
        if self._flush_handle is None:
            self._flush_soon()

    def share_tokens(self, fingerprint: str, chunks: list[tuple[int, bytes]]) -> None:
        """Publish chunks this process tokenized (``PrefixTokenCache.on_stored``); callable from any
        thread. They are queued and leave with the next flush of books and releases, at most one a
        ``min_interval_s``: one "t" message per ~8k token ids where each stored batch (about one per
        request) was a message of its own, each costing far more than its bytes (docs/router.md,
        "Chunks ride with the bookings"). Past ``MAX_PENDING_TOKENS`` queued, chunks are dropped and
        counted (``kind="tokens", direction="dropped"``): a peer then tokenizes them itself."""
        loop = self._loop
        if loop is None or self._pub is None:
            return
        with self._tokens_lock:
            room = MAX_PENDING_TOKENS - self._pending_token_count
            kept = []
            for key, ids in chunks:  # token ids as uint32 bytes (indexer/prefix_tokens.py)
                count = len(ids) >> 2
                if count > room or count > TOKENS_PER_MESSAGE:  # a chunk is a few hundred characters
                    self.stats.count("tokens", "dropped")
                    continue
                kept.append((key, ids))
                room -= count
            if not kept:
                return
            self._pending_tokens.append((fingerprint, kept))
            self._pending_token_count = MAX_PENDING_TOKENS - room
            wake, self._tokens_wake = not self._tokens_wake, True
        if not wake:
            return  # a flush is asked for already: it takes these too
        if threading.get_ident() == self._loop_thread:
            self._flush_later()
            return
        try:
            loop.call_soon_threadsafe(self._flush_later)
        except RuntimeError:  # the loop has closed: we are stopping
            pass

    def publish_snapshot(self) -> None:
        self.flush()  # the changes before it go first, so it never runs ahead of them
        self._send("s", [[p, t, tok, _RES[r]] for p, t, tok, r in self.ledger.local_bookings()])

    # ---- receiving -------------------------------------------------------------------------
    def handle(self, frames: list[bytes]) -> None:
        """Apply one received message; never raises."""
        if len(frames) == 2 and frames[1][4:4 + len(self._own)] == self._own:
            return  # our own, back through the forwarder: its origin follows version and kind
        try:
            kind, origin, seq, body = decode(frames, self.max_bookings_per_origin)
        except BadFrame as exc:
            self.stats.count("bad", "dropped")
            log.debug("booking bus: dropped a bad frame (%s)", exc)
            return
        except Exception:  # belt and braces: a receive loop must not die over a frame
            self.stats.count("bad", "dropped")
            return
        if origin == self.origin:
            return  # our own, back through the forwarder or our own bind
        if origin in self.forgotten:
            if kind != "s":  # a straggler from an origin timed out: only its full snapshot brings it back
                self.stats.count("stale", "dropped")
                return
            del self.forgotten[origin]  # it was cut off, not dead: its snapshot is its whole state
            log.info("booking bus: peer %s is back", origin)
        now = self.clock()
        peer = self.peers.get(origin)
        if peer is None:
            if len(self.peers) >= self.max_origins:
                self.stats.count("full", "dropped")
                return
            peer = self.peers[origin] = _Peer(now)
            log.info("booking bus: peer %s joined", origin)
        if seq <= peer.seq:
            self.stats.count("stale", "dropped")  # a duplicate (second path) or reordered: snapshots repair
            return
        if peer.seq and seq > peer.seq + 1:
            self.stats.count("lost", "dropped", seq - peer.seq - 1)
        peer.seq, peer.last_seen = seq, now
        name = KINDS[kind]
        led = self.ledger
        if kind == "m":
            got = {"b": 0, "r": 0}
            for op, change in body:
                if self._apply(origin, op, change):
                    got[op] += 1
            for op, n in got.items():
                if n:
                    self.stats.count(KINDS[op], "received", n)
        elif kind == "t":
            fingerprint, chunks = body
            if self.on_tokens is None or not self.on_tokens(fingerprint, chunks):
                self.stats.count("tokens", "dropped")  # not sharing, or another tokenizer
                return
        elif kind == "c":
            key_space, credits = body
            if self.on_credits is None or key_space != self.key_space:
                self.stats.count("credits", "dropped")  # not sharing, or keys of another block size or Python
                return
            for pod, keys in credits:
                self.on_credits(pod, keys)
        elif kind == "w":
            key_space, withdrawals = body
            if self.on_withdrawals is None or key_space != self.key_space:
                self.stats.count("withdrawals", "dropped")  # not sharing, or keys of another block size or Python
                return
            for pod, keys in withdrawals:
                self.on_withdrawals(pod, keys)
        elif kind == "l":
            if self.on_spent is None:
                self.stats.count("limits", "dropped")  # this process keeps no buckets to charge
                return
            for caller, requests, tokens in body:
                self.on_spent(caller, requests, tokens)
        elif kind == "s":
            bookings, listed = body
            added, released = led.replace_origin(origin, bookings, self.max_bookings_per_origin)
            self.stats.repaired += added + released
            over = listed - led.foreign_count(origin)
            if over > 0:
                self.stats.count("full", "dropped", over)
        elif not self._apply(origin, kind, body):
            return
        self.stats.count(name, "received")

    def _apply(self, origin: str, kind: str, body: tuple) -> bool:
        """One foreign book ("b") or release ("r"); False if a book did not fit."""
        led = self.ledger
        if kind == "b":
            pod, ticket, tokens, res = body
            if not led.apply_foreign(origin, "book", pod, ticket, tokens, res, self.max_bookings_per_origin) \
                    and led.foreign_count(origin) >= self.max_bookings_per_origin:
                self.stats.count("full", "dropped")
                return False
        else:
            pod, ticket, res = body
            led.apply_foreign(origin, "release", pod, ticket, resource=res)
        return True

    def expire(self) -> list[str]:
        """Drop the bookings of origins silent for ``peer_timeout_s``; the origins dropped."""
        now = self.clock()
        gone = [o for o, p in self.peers.items() if now - p.last_seen > self.peer_timeout_s]
        for origin in gone:
            del self.peers[origin]
            n = self.ledger.forget_origin(origin)
            self.forgotten[origin] = None
            while len(self.forgotten) > MAX_FORGOTTEN:
                self.forgotten.popitem(last=False)
            self.stats.peer_timeouts += 1
            log.warning("booking bus: peer %s silent for %.1fs: dropped its %d bookings", origin,
                        self.peer_timeout_s, n)
        return gone

    # ---- lifecycle -------------------------------------------------------------------------
    def set_peers(self, endpoints: Iterable[str]) -> None:
        """Connect the SUB socket to exactly ``endpoints`` plus the static ones and the siblings."""
        if self._sub is None:
            return
        self._resolved = list(endpoints)
        wanted = set(self.static_peers) | set(self._resolved) | set(self.siblings() if self.siblings else ())
        for ep in sorted(self.connected - wanted):
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(ep)
            self.connected.discard(ep)
        for ep in sorted(wanted - self.connected):
            try:
                self._sub.connect(ep)
                self.connected.add(ep)
            except zmq.ZMQError as exc:
                log.warning("booking bus: cannot connect to %s: %s", ep, exc)

    async def start(self) -> None:
        self._ctx = zmq.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if self.key is not None and self.pub_bind:
            self._auth = self.key.guard(self._ctx)
            self.key.serve(pub)
        elif self.key is not None:
            self.key.dial(pub)
        for ep in self.pub_bind:
            pub.bind(ep)
            self.bound.append(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        for ep in self.pub_connect:
            pub.connect(ep)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        if self.key is not None:
            self.key.dial(sub)
        self._pub, self._sub = pub, sub
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.set_peers([])
        if self.resolve_peers is not None:
            await self._resolve_once()
        self.ledger.on_change = self.on_change
        self.publish_snapshot()
        # a plain socket read from the loop's own reader callback: zmq.asyncio's futures and flag
        # enums cost more than the messages' handling here (docs/router.md, "The booking bus's cost")
        self._fd = sub.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._readable)
        self._loop.call_soon(self._readable)  # whatever arrived before the reader was added
        self._tasks = [asyncio.create_task(self._tick(), name="booking-bus-tick")]
        if self.resolve_peers is not None:
            self._tasks.append(asyncio.create_task(self._resolve_loop(), name="booking-bus-peers"))
        if self.siblings is not None:
            self._tasks.append(asyncio.create_task(self._siblings_loop(), name="booking-bus-siblings"))

    def _readable(self) -> None:
        """Drain the SUB socket. Its descriptor signals edges, not levels: it fires again only once
        the socket has been read dry, so this reads until ``zmq.Again``; after ``RECV_BATCH``
        messages, or once it has taken ``RECV_BYTES``, it yields to the event loop and goes on in a
        later turn (what a message costs to apply grows with its size, not its count)."""
        sub = self._sub
        if sub is None:
            return
        taken = 0
        for _ in range(RECV_BATCH):
            if taken >= RECV_BYTES:
                break
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # try again shortly: the descriptor may not fire again by itself
                log.warning("booking bus: receive failed: %s", exc)
                if self._loop is not None:
                    self._loop.call_later(0.1, self._readable)
                return
            taken += sum(map(len, frames))
            self.handle(frames)
        if self._loop is not None:
            self._loop.call_soon(self._readable)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_s)
            try:
                self.publish_snapshot()
                self.expire()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("booking bus: snapshot round failed")

    async def _resolve_once(self) -> None:
        assert self.resolve_peers is not None
        try:
            self.set_peers(await self.resolve_peers())
        except Exception as exc:  # a flaky resolver keeps the peers as they are
            log.warning("booking bus: resolving peers failed (%s); keeping %d", exc, len(self.connected))

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            await self._resolve_once()

    async def _siblings_loop(self) -> None:
        while True:
            await asyncio.sleep(SIBLINGS_INTERVAL_S)
            try:
                self.set_peers(self._resolved)
            except Exception as exc:  # keep the peers as they are
                log.warning("booking bus: looking for sibling workers failed (%s)", exc)

    async def stop(self) -> None:
        self.flush()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        if self.ledger.on_change == self.on_change:
            self.ledger.on_change = None
        for s in (self._pub, self._sub):
            if s is not None:
                s.close(linger=0)
        self._pub = self._sub = None
        self._loop = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class BusCollector(Collector):
    """``kvroute_booking_bus_*`` and ``kvroute_booking_peers`` read from a bus at scrape time."""

    def __init__(self, bus: BookingBus):
        self.bus = bus

    def describe(self):
        return []

    def collect(self):
        bus = self.bus
        c = CounterMetricFamily("kvroute_booking_bus_messages", "Booking-bus messages by kind (book, release, "
                                "snapshot, batch, tokens, credits, withdrawals, limits; dropped: bad, stale, lost, "
                                "full) and direction (sent, received, dropped; coalesced: booked and released before "
                                "it was sent, so neither was)", labels=["kind", "direction"])
        for (kind, direction), n in sorted(bus.stats.messages.items()):
            c.add_metric([kind, direction], float(n))
        yield c
        t = CounterMetricFamily("kvroute_booking_bus_peer_timeouts", "Peers silent past booking_bus_peer_timeout_s "
                                "whose bookings were dropped")
        t.add_metric([], float(bus.stats.peer_timeouts))
        yield t
        r = CounterMetricFamily("kvroute_booking_bus_repaired_bookings", "Foreign bookings a snapshot added or "
                                "released because their own message was lost")
        r.add_metric([], float(bus.stats.repaired))
        yield r
        g = GaugeMetricFamily("kvroute_booking_peers", "Other router processes heard from within the timeout")
        g.add_metric([], float(len(bus.peers)))
        yield g
        f = GaugeMetricFamily("kvroute_booking_foreign_bookings", "Bookings held for other router processes")
        f.add_metric([], float(bus.ledger.foreign_count()))
        yield f
        i = GaugeMetricFamily("kvroute_booking_bus_info", "This process's origin id on the booking bus",
                              labels=["origin"])
        i.add_metric([bus.origin], 1.0)
        yield i


class Forwarder:
    """XSUB/XPUB forwarder for the workers of one ``kvroute serve`` beside replicas, in a thread of the
    parent (workers alone reach each other straight: the module's docstring).

    Binds XSUB (the workers' PUBs connect) and XPUB (their SUBs connect) on 127.0.0.1 at free
    ports; ``extra_binds`` also exposes XPUB to replicas (``booking_bus_bind``). Messages from
    replicas do not come through here: each worker subscribes to them itself."""

    def __init__(self, hwm: int = 10_000, host: str = "127.0.0.1", extra_binds: Iterable[str] = (),
                 key: BusKey | None = None):
        self._ctx = zmq.Context()
        self._auth = key.guard(self._ctx) if key is not None else None
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xpub = self._ctx.socket(zmq.XPUB)
        for s in (self._xsub, self._xpub):
            s.setsockopt(zmq.LINGER, 0)
            if key is not None:  # both bind: the workers' sockets (and replicas') are its clients
                key.serve(s)
        self._xsub.setsockopt(zmq.RCVHWM, hwm)
        self._xpub.setsockopt(zmq.SNDHWM, hwm)
        port_in = self._xsub.bind_to_random_port(f"tcp://{host}")
        port_out = self._xpub.bind_to_random_port(f"tcp://{host}")
        for ep in extra_binds:
            self._xpub.bind(ep)
        self.pub_endpoint = f"tcp://{host}:{port_in}"   # where workers' PUB sockets connect
        self.sub_endpoint = f"tcp://{host}:{port_out}"  # where workers' SUB sockets connect
        self._control_ep = f"inproc://kvroute-bookbus-control-{id(self)}"
        self._control = self._ctx.socket(zmq.PAIR)
        self._control.bind(self._control_ep)
        self._thread = threading.Thread(target=self._run, name="booking-bus-forwarder", daemon=True)

    def _run(self) -> None:
        peer = self._ctx.socket(zmq.PAIR)
        peer.connect(self._control_ep)
        try:
            zmq.proxy_steerable(self._xsub, self._xpub, None, peer)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                log.warning("booking bus forwarder stopped: %s", exc)
        finally:
            peer.close(linger=0)
            self._xsub.close(linger=0)
            self._xpub.close(linger=0)

    def start(self) -> Forwarder:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._control.send(b"TERMINATE")
            self._thread.join(timeout_s)
        self._control.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if not self._thread.is_alive():
            self._ctx.term()
