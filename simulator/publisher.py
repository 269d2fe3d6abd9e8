"""KV-event publishing as vLLM's ``ZmqEventPublisher`` does it: a PUB socket and a ROUTER replay socket.

Live frames: ``[topic, seq (8 bytes big-endian), payload]``, seq from 0, one per batch. The ROUTER
keeps the last ``buffer_steps`` batches; a DEALER that sends ``[b"", start_seq]`` gets
``[b"", topic, seq, payload]`` for each buffered batch with seq >= start, then the end marker
``[b"", b"", 0xFF..FF, b""]`` (the vLLM >= 0.26 layout).

Two faults live here: ``stopped`` (batches are numbered and buffered but never reach the wire, as
if lost: a subscriber sees a gap once they resume and can replay it) and ``restart()`` (sequence
back to 0 and an empty buffer, as after an engine restart).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from simulator.events import END_SEQ, KVEventsConfig, encode_batch, is_bind
from simulator.metrics import PodMetrics
from simulator.tasks import cancel_and_wait

log = logging.getLogger("kvroute.sim.events")


class EventPublisher:
    def __init__(self, config: KVEventsConfig, metrics: PodMetrics, ctx: zmq.Context,
                 actx: zmq.asyncio.Context, clock=time.time, dp_rank: int = 0):
        self.config = config
        self.dp_rank = dp_rank  # carried in every batch, as vLLM's publisher of that rank does
        self.metrics = metrics
        self.topic = config.topic.encode("utf-8")
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(config.buffer_steps, 1))
        self.stopped = False
        self._clock = clock
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if is_bind(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        if config.replay_endpoint:
            self._router = actx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(config.replay_endpoint)

    def start(self) -> None:
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(self._router))

    def publish(self, events: list) -> None:
        """Send one batch (never blocks: a socket at its high-water mark drops, as in vLLM)."""
        if not events:
            return
        payload = encode_batch(self._clock(), events, self.dp_rank)
        seq = self.seq.to_bytes(8, "big")
        self.buffer.append((self.seq, payload))
        self.seq += 1
        if self.stopped:
            self.metrics.events_dropped.inc()
            return
        try:
            self._pub.send_multipart((self.topic, seq, payload), flags=zmq.NOBLOCK, copy=False)
            self.metrics.event_batches.inc()
        except zmq.Again:
            self.metrics.events_dropped.inc()

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await router.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as exc:  # pragma: no cover - socket closed under us
                log.warning("replay socket error: %s", exc)
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) > 8:
                log.warning("invalid replay request ignored (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            try:
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        await router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
                await router.send_multipart([identity, b"", b"", END_SEQ, b""])
            except zmq.ZMQError as exc:  # unroutable peer gone
                log.info("replay reply failed: %s", exc)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
