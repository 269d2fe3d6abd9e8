"""ZeroMQ subscriber: each pod's KV-event stream into the prefix index, in order, repaired.

One SUB socket per pod endpoint (a pod with data-parallel ranks has one endpoint per rank), each
read by its own task, so one pod's events apply strictly in order and a slow pod never holds up
another. Per stream, by sequence number:

* ``seq == applied + 1``: apply.
* ``seq > applied + 1`` (a gap; PUB drops silently at its high-water mark): ask the pod's replay
  ROUTER through a DEALER for everything from ``applied`` on. The first reply must be the batch we
  applied last, with the same timestamp; if it is not, the engine restarted while we were away
  (its new stream merely overtook our old position), so the pod's rank is cleared and replayed
  from 0. Without a replay endpoint, or when the buffer no longer holds the gap, the missing
  batches are counted as lost.
* ``seq`` not above the last live one: the engine restarted (sequences restart at 0). The rank's
  entries are cleared before the new batch applies (and its own missed start replayed).
* a reconnect of the SUB after a disconnect (``verify_after_reconnect``): the publisher may be a
  restarted engine, so its replay buffer is asked at once whether it still holds our last batch;
  if not, the pod's rank is cleared and rebuilt from the buffer. Waiting for the next live batch
  instead would leave an idle restarted engine's old entries in place, and the first batch after a
  reconnect can be lost before the subscription reaches the new publisher; so a second look at the
  buffer a moment later (``settle_after_reconnect``) applies what the live stream dropped.
* on connect (``catch_up_on_connect``): catch up from the replay buffer (from 0) at once, not
  on the pod's next batch: an idle pod publishes nothing, and a router restarted beside it would
  otherwise never learn what it holds. Live batches already covered by that replay are dropped
  as duplicates if their timestamp matches the replayed one, else the engine restarted meanwhile.
* a stream's first batch with ``seq > 0`` and nothing applied yet (the catch-up on connect
  failed, or is off): catch up from the replay buffer (from 0).
* AllBlocksCleared clears the rank (the index does it).

Replay replies are parsed by frame count, so both layouts work: ``[b"", seq, payload]`` (vLLM
< 0.26) and ``[b"", topic, seq, payload]`` (>= 0.26); the end marker is an empty last frame or
seq ``0xFFFF_FFFF_FFFF_FFFF``. Every wait has a timeout: a slow replay client's replies (even the
end marker) may be dropped by the ROUTER.

Trust boundary: the event endpoints are trusted to describe their pod's cache. A forged
``BlockStored`` poisons the index (requests routed where the prefix is not); it cannot reach a pod
or the router's memory beyond the bounds here: every frame is at most ``max_frame_bytes`` (ZeroMQ's
``MAXMSGSIZE``: a bigger one drops the connection, which reconnects), and a replay answer at most
``max_replay_batches`` batches and ``max_replay_bytes`` bytes (past either, the replay counts as
failed and its buffer is freed). Where the publishers support it, CURVE (``curve_server_key``,
with this subscriber's own ``curve_public_key``/``curve_secret_key``) authenticates and encrypts
both the PUB stream and the replay socket, so only the holder of the server's secret key can
publish events the router accepts.

Socket errors recreate the socket with exponential backoff (libzmq itself reconnects a connected
SUB). Bad input is counted (``decode_errors``) and dropped; nothing a pod sends stops the task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.events import END_SEQ, DecodeError, EventBatch, decode_frame, decode_payload, decode_seq, encode_seq
from indexer.index import PrefixIndex

log = logging.getLogger("kvroute.indexer.subscriber")


@dataclass
class StreamState:
    """Ordering state and counters of one endpoint (one pod, one DP rank)."""

    pod_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int | None = None
    one_rank: bool = False              # the pod is this one engine: index every batch as its rank 0
    rank: int | None = None             # the rank its last applied batch was indexed under (what a restart clears)
    applied: int | None = None          # last applied sequence number
    last_live: int | None = None        # last sequence number seen on the live stream
    last_ts: float | None = None        # publish time of the last applied batch
    caught_up_ts: dict[int, float] | None = None  # seq -> publish time of the on-connect catch-up
    batches: int = 0
    events: int = 0
    gaps: int = 0
    lost_batches: int = 0
    replays: int = 0
    replay_failures: int = 0
    replayed_batches: int = 0
    restarts: int = 0
    resyncs: int = 0
    duplicates: int = 0
    decode_errors: int = 0
    apply_errors: int = 0
    reconnects: int = 0
    disconnects: int = 0
    suspect: bool = False               # the connection dropped since the last batch
    disconnected_at: float | None = None  # monotonic time of a disconnect not yet followed by a connect
    last_event_mono: float | None = None
    lag_s: float | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)
    # the live reader and the reconnect check take turns: both move ``applied`` and may clear
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def snapshot(self, now_mono: float) -> dict[str, Any]:
        return {
            "pod_id": self.pod_id, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
            "dp_rank": self.dp_rank, "last_seq": self.applied, "batches": self.batches, "events": self.events,
            "gaps": self.gaps, "lost_batches": self.lost_batches, "replays": self.replays,
            "replay_failures": self.replay_failures, "replayed_batches": self.replayed_batches,
            "restarts": self.restarts, "resyncs": self.resyncs, "duplicates": self.duplicates,
            "decode_errors": self.decode_errors,
            "apply_errors": self.apply_errors, "reconnects": self.reconnects, "disconnects": self.disconnects,
            "last_event_age_s": None if self.last_event_mono is None else max(0.0, now_mono - self.last_event_mono),
            "lag_s": self.lag_s,
        }


ReplayFn = Callable[[int], Awaitable["list[tuple[int, EventBatch]] | None"]]
ApplyFn = Callable[[int, EventBatch], None]
ClearFn = Callable[[], None]


async def handle_live(st: StreamState, seq: int, batch: EventBatch, apply: ApplyFn, clear: ClearFn,
                      replay: ReplayFn | None) -> None:
    """The ordering rules for one live batch (pure apart from the three callbacks)."""
    if st.last_live is not None and seq <= st.last_live:
        st.restarts += 1
        log.warning("pod %s (%s): sequence went back from %d to %d: engine restarted, clearing its entries",
                    st.pod_id, st.endpoint, st.last_live, seq)
        clear()
        st.applied = st.last_ts = None
    if st.caught_up_ts is not None:
        if st.applied is not None and seq <= st.applied and st.caught_up_ts.get(seq) != batch.ts:
            # not the batch the on-connect replay gave us under that number: a new engine
            st.restarts += 1
            log.warning("pod %s (%s): live batch %d differs from the replayed one: engine restarted, clearing "
                        "its entries", st.pod_id, st.endpoint, seq)
            clear()
            st.applied = st.last_ts = None
        if st.applied is None or seq > st.applied:
            st.caught_up_ts = None  # the live stream has passed the catch-up
    st.last_live = seq
    if st.applied is not None and seq <= st.applied:
        st.duplicates += 1  # already applied from a replay
        return
    if st.applied is None:
        if seq > 0:
            if replay is not None:
                await _catch_up(st, 0, seq, apply, replay)
            expected = 0 if st.applied is None else st.applied + 1
            st.lost_batches += max(0, seq - expected)
    elif seq > st.applied + 1 or (st.suspect and replay is not None):
        # a gap; or the connection dropped since our last batch, so even the next sequence
        # number may come from a restarted engine: verify against the replay buffer
        if seq > st.applied + 1:
            st.gaps += 1
        if replay is None:
            st.lost_batches += seq - st.applied - 1
        else:
            got = await _replay(st, st.applied, replay)
            if got:
                first_seq, first_batch = got[0]
                if first_seq == st.applied and first_batch.ts == st.last_ts:
                    await _apply_replayed(st, got, st.applied + 1, seq, apply)
                else:
                    # our last batch is not in the pod's buffer as we saw it: either a new engine's
                    # stream overtook our old position, or the buffer no longer reaches back to it
                    if first_seq <= st.applied:
                        st.restarts += 1
                        why = "engine restarted"
                    else:
                        st.resyncs += 1
                        why = "replay buffer no longer reaches it"
                    log.warning("pod %s (%s): replay does not hold our last batch %d (%s): clearing and rebuilding",
                                st.pod_id, st.endpoint, st.applied, why)
                    clear()
                    st.applied = st.last_ts = None
                    if first_seq > 0:
                        got = await _replay(st, 0, replay) or got
                    await _apply_replayed(st, got, 0, seq, apply)
                    # what the buffer no longer holds of the new state is lost to us
                    st.lost_batches += min(got[0][0], seq)
            expected = 0 if st.applied is None else st.applied + 1
            if seq > expected and st.applied is not None:
                st.lost_batches += seq - expected
    st.suspect = False
    _apply(st, seq, batch, apply)


async def catch_up_on_connect(st: StreamState, apply: ApplyFn, replay: ReplayFn) -> None:
    """Everything the pod's replay buffer holds, applied before any live batch is read."""
    got = await _replay(st, 0, replay)
    if not got or st.applied is not None or st.last_live is not None:
        return
    st.lost_batches += got[0][0]  # the buffer no longer reaches back to the start
    await _apply_replayed(st, got, 0, max(s for s, _ in got) + 1, apply)
    if st.applied is not None:
        st.caught_up_ts = {s: b.ts for s, b in got}


async def verify_after_reconnect(st: StreamState, apply: ApplyFn, clear: ClearFn, replay: ReplayFn) -> None:
    """The SUB reconnected to its publisher, which may be a restarted engine: ask its replay buffer
    now rather than wait for its next live batch (an idle engine publishes none, and the first batch
    after a reconnect can be lost before the subscription reaches the new publisher).

    The buffer still holding our last batch as we saw it: the same engine; apply what we missed.
    Anything else (an empty buffer, a different batch under our number, a buffer that starts past
    it): the pod is cleared and rebuilt from what the buffer holds."""
    if st.applied is None:
        return
    got = await _replay(st, st.applied, replay)
    if got is None:
        return  # nothing reliable; the next live batch is still checked (st.suspect)
    if got and got[0][0] == st.applied and got[0][1].ts == st.last_ts:
        await _apply_replayed(st, got, st.applied + 1, max(s for s, _ in got) + 1, apply)
        st.suspect = False
        return
    st.restarts += 1
    log.warning("pod %s (%s): after a reconnect the replay buffer does not hold our last batch %d: engine "
                "restarted, clearing and rebuilding", st.pod_id, st.endpoint, st.applied)
    clear()
    st.applied = st.last_ts = st.last_live = None
    st.caught_up_ts = None
    if got and got[0][0] > 0:
        got = await _replay(st, 0, replay) or got
    if got:
        st.lost_batches += got[0][0]
        await _apply_replayed(st, got, 0, max(s for s, _ in got) + 1, apply)
        # live batches this replay already covered are duplicates if their timestamps match
        st.caught_up_ts = {s: b.ts for s, b in got}
    st.suspect = False


async def settle_after_reconnect(st: StreamState, apply: ApplyFn, replay: ReplayFn) -> None:
    """A moment after a reconnect: apply what the replay buffer holds past our last batch (batches
    the live stream dropped before our subscription reached the publisher). Only when the buffer
    still holds our last batch as we saw it; anything else is left to the live ordering rules."""
    start = 0 if st.applied is None else st.applied
    got = await _replay(st, start, replay)
    if not got:
        return
    if st.applied is None:
        await _apply_replayed(st, got, 0, max(s for s, _ in got) + 1, apply)
    elif got[0][0] == st.applied and got[0][1].ts == st.last_ts:
        await _apply_replayed(st, got, st.applied + 1, max(s for s, _ in got) + 1, apply)
    else:
        return
    st.caught_up_ts = {**(st.caught_up_ts or {}), **{s: b.ts for s, b in got}}


async def _catch_up(st: StreamState, start: int, seq: int, apply: ApplyFn, replay: ReplayFn) -> None:
    got = await _replay(st, start, replay)
    if got:
        if got[0][0] > start:  # the buffer no longer reaches back to the start
            st.lost_batches += min(got[0][0], seq) - start
        await _apply_replayed(st, got, start, seq, apply)


async def _replay(st: StreamState, start: int, replay: ReplayFn) -> list[tuple[int, EventBatch]] | None:
    st.replays += 1
    try:
        got = await replay(start)
    except Exception as exc:  # a replay that fails is counted, never fatal
        log.warning("pod %s: replay from %d failed: %s", st.pod_id, start, exc)
        got = None
    if got is None:
        st.replay_failures += 1
    return got


async def _apply_replayed(st: StreamState, got: list[tuple[int, EventBatch]], start: int, stop: int,
                          apply: ApplyFn) -> None:
    """The replayed batches in ``[start, stop)`` not applied yet, in order, one event-loop turn each: a
    replay may hold up to ``max_replay_batches`` of them, which applied in one go would hold the loop
    (and every request) for seconds."""
    for s, b in got:
        if start <= s < stop and (st.applied is None or s > st.applied):
            st.replayed_batches += 1
            _apply(st, s, b, apply)
            await asyncio.sleep(0)


def _apply(st: StreamState, seq: int, batch: EventBatch, apply: ApplyFn) -> None:
    try:
        apply(seq, batch)
    except Exception:  # a bug or a hostile batch must not stop the stream
        st.apply_errors += 1
        log.exception("pod %s: applying batch %d failed", st.pod_id, seq)
    st.applied = seq
    st.last_ts = batch.ts
    st.batches += 1
    st.events += len(batch.events)


class KVEventSubscriber:
    """Feeds a :class:`PrefixIndex` from the pods' ZMQ KV-event streams; see the module docstring."""

    def __init__(self, index: PrefixIndex, *, context: zmq.asyncio.Context | None = None,
                 replay_timeout_s: float = 2.0, reconnect_min_s: float = 0.1, reconnect_max_s: float = 5.0,
                 rcvhwm: int = 100_000, catch_up_on_connect: bool = True,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 max_frame_bytes: int = 16 * 1024 * 1024, max_replay_batches: int = 20_000,
                 max_replay_bytes: int = 256 * 1024 * 1024, curve: CurveKeys | None = None):
        self.index = index
        self._ctx = context or zmq.asyncio.Context.instance()
        self.replay_timeout_s = replay_timeout_s
        self.settle_s = 1.0  # after a reconnect: when to look for batches the live stream dropped
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.rcvhwm = rcvhwm
        self.catch_up_on_connect = catch_up_on_connect
        self.bounds = SocketBounds(max_frame_bytes, max_replay_batches, max_replay_bytes, curve)
        self.clock = clock
        self.wall_clock = wall_clock
        self._streams: dict[tuple[str, str], StreamState] = {}
        self._running = False

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._running = True
        for st in self._streams.values():
            self._spawn(st)

    async def stop(self) -> None:
        self._running = False
        tasks = [st.task for st in self._streams.values() if st.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for st in self._streams.values():
            st.task = None

    def add_endpoint(self, pod_id: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                     model: str | None = None, dp_rank: int | None = None, one_rank: bool = False) -> None:
        """Subscribe to one pod endpoint (one per DP rank). ``model`` also registers the pod in the
        index if it is not there yet; otherwise the router must ``index.add_pod`` it (events of
        pods the index does not know are counted and dropped). ``one_rank``: the pod is one engine
        of a data-parallel pod (``<pod>#<r>``), whose batches carry its global rank; the index
        keeps it as the pod's only source, rank 0, whatever that rank is."""
        if model is not None and not self.index.has_pod(pod_id):
            self.index.add_pod(pod_id, model)
        key = (pod_id, endpoint)
        if key in self._streams:
            return
        st = StreamState(pod_id, endpoint, replay_endpoint, topic, dp_rank, one_rank)
        self._streams[key] = st
        if self._running:
            self._spawn(st)

    def remove_pod(self, pod_id: str) -> None:
        """Stop reading a pod's endpoints and drop it from the index, at once."""
        for key in [k for k in self._streams if k[0] == pod_id]:
            st = self._streams.pop(key)
            if st.task is not None:
                st.task.cancel()
        self.index.remove_pod(pod_id)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per endpoint (keyed ``pod_id@endpoint``): sequence, gaps, replays, restarts, errors, lag."""
        now = self.clock()
        return {f"{p}@{e}": st.snapshot(now) for (p, e), st in self._streams.items()}

    def _spawn(self, st: StreamState) -> None:
        if st.task is None or st.task.done():
            st.task = asyncio.get_running_loop().create_task(self._run(st), name=f"kv-events:{st.pod_id}")

    # --- reading ----------------------------------------------------------------------------------
    async def _run(self, st: StreamState) -> None:
        backoff = self.reconnect_min_s
        first = True
        while True:
            sock = self._ctx.socket(zmq.SUB)
            monitor = None
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
                self.bounds.apply(sock)
                sock.setsockopt(zmq.RECONNECT_IVL, int(self.reconnect_min_s * 1000))
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.reconnect_max_s * 1000))
                sock.setsockopt(zmq.SUBSCRIBE, st.topic.encode("utf-8"))
                sock.setsockopt(zmq.RCVTIMEO, 1000)  # wake up once a second to notice a connection gone for good
                st.disconnected_at = None
                if "*" in st.endpoint or "::" in st.endpoint:
                    sock.bind(st.endpoint)
                else:
                    sock.connect(st.endpoint)
                    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
                    st.watcher = asyncio.get_running_loop().create_task(self._watch(st, monitor),
                                                                        name=f"kv-events-monitor:{st.pod_id}")
                if not first:
                    st.reconnects += 1
                    st.suspect = True
                elif st.replay_endpoint and self.catch_up_on_connect:
                    # subscribed first, so whatever is published meanwhile waits in the SUB queue
                    async with st.lock:
                        await catch_up_on_connect(st, lambda s, b: self._apply(st, b), self._replay_fn(st))
                first = False
                while True:
                    try:
                        frames = await sock.recv_multipart()
                    except zmq.Again:
                        # libzmq does not reconnect after a protocol error (a frame over
                        # max_frame_bytes): recreate the socket when no connect follows a disconnect
                        gone = st.disconnected_at
                        if gone is not None and self.clock() - gone > self.reconnect_max_s + 1.0:
                            raise zmq.ZMQError(msg="disconnected and not reconnected (a protocol error such as "
                                                   "a frame over max_frame_bytes)") from None
                        continue
                    backoff = self.reconnect_min_s
                    await self._on_frames(st, frames)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.warning("pod %s: KV event socket %s failed (%s); retrying in %.1fs",
                            st.pod_id, st.endpoint, exc, backoff)
            except Exception:
                log.exception("pod %s: KV event stream %s failed; retrying in %.1fs", st.pod_id, st.endpoint, backoff)
            finally:
                if st.watcher is not None:
                    st.watcher.cancel()
                    await asyncio.gather(st.watcher, return_exceptions=True)
                    st.watcher = None
                if monitor is not None:
                    try:
                        sock.disable_monitor()
                    except zmq.ZMQError:
                        pass
                    monitor.close(linger=0)
                sock.close(linger=0)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_s)

    async def _watch(self, st: StreamState, monitor: zmq.asyncio.Socket) -> None:
        """The SUB's connection events: a disconnect marks the stream suspect; the reconnect after it
        checks the publisher's replay buffer at once (``verify_after_reconnect``)."""
        while True:
            try:
                msg = parse_monitor_message(await monitor.recv_multipart())
            except ValueError:
                continue
            if msg.get("event") == zmq.EVENT_DISCONNECTED:
                st.disconnects += 1
                st.suspect = True
                st.disconnected_at = self.clock()
                continue
            st.disconnected_at = None
            if msg.get("event") == zmq.EVENT_CONNECTED and st.suspect and st.replay_endpoint:
                async with st.lock:
                    if st.suspect:
                        await verify_after_reconnect(st, lambda s, b: self._apply(st, b),
                                                     lambda: self.index.clear_pod(st.pod_id, self._stream_rank(st)),
                                                     self._replay_fn(st))
                # a batch published while our subscription was still on its way to the publisher
                # never reaches the SUB: once that has settled, take it from the replay buffer
                await asyncio.sleep(self.settle_s)
                async with st.lock:
                    await settle_after_reconnect(st, lambda s, b: self._apply(st, b), self._replay_fn(st))

    async def _on_frames(self, st: StreamState, frames: list[bytes]) -> None:
        try:
            _topic, seq, batch = decode_frame(frames)
        except DecodeError as exc:
            st.decode_errors += 1
            log.debug("pod %s: dropped a malformed KV event frame: %s", st.pod_id, exc)
            return
        st.last_event_mono = self.clock()
        st.lag_s = max(0.0, self.wall_clock() - batch.ts) if batch.ts > 0 else None
        replay = None
        if st.replay_endpoint and (st.applied is not None or st.last_live is not None or self.catch_up_on_connect):
            replay = self._replay_fn(st)
        async with st.lock:
            await handle_live(st, seq, batch, lambda s, b: self._apply(st, b), lambda: self._clear(st, batch), replay)

    def _replay_fn(self, st: StreamState) -> ReplayFn:
        endpoint = st.replay_endpoint
        if endpoint is None:  # callers ask only for a stream that has a replay endpoint
            raise ValueError(f"pod {st.pod_id} has no replay endpoint")

        async def replay(start: int) -> list[tuple[int, EventBatch]] | None:
            return await request_replay(self._ctx, endpoint, start, self.replay_timeout_s,
                                        on_decode_error=lambda: _count_decode_error(st), bounds=self.bounds)
        return replay

    def _rank(self, st: StreamState, batch: EventBatch) -> int:
        if st.one_rank:
            return 0
        rank = batch.dp_rank if batch.dp_rank is not None else st.dp_rank
        return rank or 0

    def _stream_rank(self, st: StreamState) -> int:
        """The rank this stream's entries are indexed under, for a restart found without a batch in
        hand (a reconnect): the rank of its last batch. Not ``dp_rank or 0``: a pod with one stream per
        rank (several ``kv_events``, not steered) lost rank 0's entries when rank 1's engine restarted,
        and rank 1 kept its stale ones."""
        if st.one_rank:
            return 0
        return st.rank if st.rank is not None else (st.dp_rank or 0)

    def _apply(self, st: StreamState, batch: EventBatch) -> None:
        st.rank = self._rank(st, batch)
        self.index.apply_batch(st.pod_id, batch.events, st.rank)

    def _clear(self, st: StreamState, batch: EventBatch) -> None:
        self.index.clear_pod(st.pod_id, self._rank(st, batch))


def _count_decode_error(st: StreamState) -> None:
    st.decode_errors += 1


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys (Z85 text, 40 characters each): the publishers' public key, and this subscriber's pair."""

    server_public: str
    public: str
    secret: str


@dataclass(frozen=True)
class SocketBounds:
    """What one event endpoint may make the subscriber hold (see the module docstring)."""

    max_frame_bytes: int = 16 * 1024 * 1024
    max_replay_batches: int = 20_000
    max_replay_bytes: int = 256 * 1024 * 1024
    curve: CurveKeys | None = None

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public.encode("ascii")
            sock.curve_publickey = self.curve.public.encode("ascii")
            sock.curve_secretkey = self.curve.secret.encode("ascii")


async def request_replay(ctx: zmq.asyncio.Context, endpoint: str, start: int, timeout_s: float,
                         on_decode_error: Callable[[], None] | None = None,
                         bounds: SocketBounds | None = None) -> list[tuple[int, EventBatch]] | None:
    """DEALER ``[b"", start]`` to a replay ROUTER; the replies until the end marker, decoded.

    Returns None if the end marker does not come within ``timeout_s`` of the previous reply
    (nothing reliable can be said then), or once more than ``bounds.max_replay_batches`` replies or
    ``bounds.max_replay_bytes`` bytes came without it (a broken or hostile endpoint). Both reply
    layouts are accepted.
    """
    bounds = bounds or SocketBounds()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    bounds.apply(sock)
    out: list[tuple[int, EventBatch]] = []
    replies = size = 0
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", encode_seq(start)])
        while True:
            if not await sock.poll(int(timeout_s * 1000)):  # POLLIN, the default
                return None
            frames = await sock.recv_multipart()
            replies += 1
            size += sum(len(f) for f in frames)
            if replies > bounds.max_replay_batches + 1 or size > bounds.max_replay_bytes:
                log.warning("replay from %s: no end marker after %d replies (%d bytes); giving up", endpoint,
                            replies, size)
                return None
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                _topic, seq_raw, payload = frames
            elif len(frames) == 2:
                seq_raw, payload = frames
            else:
                if on_decode_error:
                    on_decode_error()
                continue
            try:
                seq = decode_seq(seq_raw)
            except DecodeError:
                if on_decode_error:
                    on_decode_error()
                continue
            if seq == END_SEQ or not payload:
                return out
            try:
                out.append((seq, decode_payload(payload)))
            except DecodeError:
                if on_decode_error:
                    on_decode_error()
    finally:
        sock.close(linger=0)
