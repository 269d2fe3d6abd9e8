"""The router's HTTP surface against real pods on loopback (small recording pods served by aiohttp).

The recording pods speak the slice of vLLM's surface these tests need (health, metrics, OpenAI
routes with SSE) and remember what they were sent, so the tests can see header stripping,
retries, streaming pass-through and upstream cancellation from the pod's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
import uvicorn
from aiohttp import web

from kvcommon.listener import GuardedHttpToolsProtocol
from kvcommon.settings import build_settings
from router.api import create_app
from router.config import RouterSettings
from router.service import Services
from tests.helpers import free_port

# ---------------------------------------------------------------------------------------------
# a recording pod
# ---------------------------------------------------------------------------------------------


@dataclass
class Pod:
    name: str
    port: int
    fail_status: int = 0          # answer this status ...
    fail_times: int = 0           # ... for the next N requests
    chunk_delay: float = 0.0      # seconds between SSE chunks
    chunks: int = 3
    hang: bool = False            # stream one chunk, then keep writing slowly until the client leaves
    first_delay: float = 0.0      # seconds before the answer starts (a queue), watching for the client leaving
    chunk_bytes: int = 0          # pad each SSE chunk's text to about this many bytes
    stall_s: float = 0.0          # seconds of silence after the first SSE chunk
    trickle: bool = False         # non-streaming: send the head and half the body, then wait for the client to leave
    written: int = 0              # SSE chunks written so far
    waiting: int = 0
    seen: list[dict] = field(default_factory=list)
    cancelled: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self, app: web.Application) -> None:
        """The pod's HTTP surface; a subclass adds to it."""
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)

    async def start(self) -> None:
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        text = (f'vllm:num_requests_waiting{{model_name="m",engine="0"}} {self.waiting}\n'
                f'vllm:num_requests_running{{model_name="m",engine="0"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} 0.25\n'
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')
        return web.Response(text=text)

    async def received(self, request: web.Request, raw: bytes, **extra: object) -> web.Response | None:
        """Record the request, wait ``first_delay`` (a queue, watching for the router closing the
        connection) and fail it ``fail_times``: the answer to give instead of the route's own, or None."""
        self.seen.append({"headers": {k.lower(): v for k, v in request.headers.items()}, "raw": raw,
                          "path": request.path, **extra})
        waited = 0.0
        while waited < self.first_delay:
            if request.transport is None or request.transport.is_closing():
                self.cancelled += 1
                return web.Response(status=499)
            await asyncio.sleep(0.02)
            waited += 0.02
        if self.fail_times > 0:
            self.fail_times -= 1
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError", "code": 500}},
                                     status=self.fail_status)
        return None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        instead = await self.received(request, raw)
        if instead is not None:
            return instead
        if self.trickle and not body.get("stream"):
            payload = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "choices": []})
            resp = web.StreamResponse(headers={"content-type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            for _ in range(500):   # 10 s at most
                if request.transport is None or request.transport.is_closing():
                    self.cancelled += 1
                    break
                await asyncio.sleep(0.02)
            return resp
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                                      "choices": [{"index": 0, "text": f"hi from {self.name}",
                                                   "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
                                     headers={"x-pod-name": self.name})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-pod-name": self.name})
        await resp.prepare(request)
        try:
            n = 10**6 if self.hang else self.chunks
            pad = "x" * self.chunk_bytes
            for i in range(n):
                chunk = {"id": "cmpl-1", "object": "text_completion",
                         "choices": [{"index": 0, "text": f"t{i} " + pad}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                self.written += 1
                if i == 0 and self.stall_s:
                    await asyncio.sleep(self.stall_s)
                await asyncio.sleep(self.chunk_delay if not self.hang else 0.02)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.cancelled += 1
            raise
        return resp


@contextlib.asynccontextmanager
async def started(pods: list):
    """``pods`` started, and stopped on the way out."""
    for p in pods:
        await p.start()
    try:
        yield pods
    finally:
        for p in pods:
            await p.stop()


def pods_running(n: int, **kw):
    return started([Pod(f"pod-{i}", free_port(), **kw) for i in range(n)])


def settings_for(pods, **kw) -> RouterSettings:
    fleet = [{"id": p.name, "url": p.url, "model": "m"} for p in pods]
    base = {"pods": fleet, "port": free_port(), "health_interval_s": 0.2, "scrape_interval_s": 0.1}
    base.update(kw)
    return build_settings(RouterSettings, base)


@contextlib.asynccontextmanager
async def running_router(settings: RouterSettings, http: Any = "auto", proxy_headers: bool = True):
    """The real app under uvicorn on a free port, in this event loop; yields (base_url, services).
    ``http``: uvicorn's protocol (its own by default; ``GuardedHttpToolsProtocol`` is kvroute serve's);
    ``proxy_headers``: uvicorn's X-Forwarded-For middleware (kvroute serve runs it with the access log only)."""
    services = Services(settings)
    app = create_app(services)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning",
                                           lifespan="on", access_log=False, http=http,
                                           proxy_headers=proxy_headers))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while not server.started:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "router did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{settings.port}", services
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def completion(stream: bool = False, prompt: str = "hello world", **kw) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream, **kw}


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


async def test_routes_models_health_ready_and_metrics():
    async with pods_running(2) as pods, running_router(settings_for(pods)) as (base, services):
        async with httpx.AsyncClient(base_url=base) as c:
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/ready")).status_code == 200
            models = (await c.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m"]
            r = await c.post("/v1/completions", json=completion())
            assert r.status_code == 200
            assert r.headers["x-kvroute-pod"] in {"pod-0", "pod-1"}
            assert r.json()["choices"][0]["text"] == f"hi from {r.headers['x-kvroute-pod']}"
            assert r.headers["x-pod-name"] == r.headers["x-kvroute-pod"]
            text = (await c.get("/metrics")).text
            assert 'kvroute_requests_total{pod="%s",policy="predicted-ttft",status="200"} 1.0' % r.headers[
                "x-kvroute-pod"] in text
            assert 'kvroute_pod_healthy{pod="pod-0"} 1.0' in text
            assert 'kvroute_pod_kv_usage{pod="pod-0"} 0.25' in text
            assert services.router.block_size == 16  # learned from vllm:cache_config_info


async def test_body_is_passed_through_untouched_and_internal_headers_are_stripped():
    async with pods_running(1) as pods, running_router(settings_for(pods)) as (base, _):
        raw = b'{"model":"m",  "prompt":"x y z", "max_tokens":2, "weird_extra": {"keep": [1,2]}}'
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/v1/completions", content=raw, headers={
                "content-type": "application/json", "x-prefiller-host-port": "evil:1", "x-prefiller-url": "http://evil",
                "x-kvroute-pod": "pod-9", "x-kvroute-anything": "1", "x-data-parallel-host-port": "evil:2",
                "x-llm-d-prefiller-host-port": "evil:3", "x-kv-cache-source-host-port": "evil:4",
                "connection": "keep-alive, x-custom-hop", "x-request-id": "req-abc", "x-user-header": "kept",
                "proxy-authorization": "secret"})
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "req-abc"
        seen = pods[0].seen[-1]
        assert seen["raw"] == raw
        names = {k.lower() for k in seen["headers"]}
        for stripped in ("x-prefiller-host-port", "x-prefiller-url", "x-kvroute-pod", "x-kvroute-anything",
                         "x-data-parallel-host-port", "proxy-authorization", "x-llm-d-prefiller-host-port",
                         "x-kv-cache-source-host-port"):
            assert stripped not in names
        assert seen["headers"]["x-user-header"] == "kept"
        assert seen["headers"]["x-request-id"] == "req-abc"


async def test_request_id_is_made_when_missing():
    async with pods_running(1) as pods, running_router(settings_for(pods)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/v1/completions", json=completion())
        rid = r.headers["x-request-id"]
        assert len(rid) >= 16 and pods[0].seen[-1]["headers"]["x-request-id"] == rid


async def test_streaming_passes_chunks_through_as_they_come():
    async with pods_running(1, chunk_delay=0.15, chunks=4) as pods, running_router(settings_for(pods)) as (base, _):
        arrivals = []
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            async with c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-kvroute-pod"] == "pod-0"
                body = b""
                async for chunk in r.aiter_raw():
                    arrivals.append(time.monotonic())
                    body += chunk
        events = [e for e in body.split(b"\n\n") if e]
        assert len(events) == 5 and events[-1] == b"data: [DONE]"
        assert [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["t0 ", "t1 ", "t2 ", "t3 "]
        # chunks arrived spread over time, not all at the end
        assert arrivals[-1] - arrivals[0] > 0.3 and len(arrivals) >= 4


async def _raw_exchange(port: int, requests: list[bytes],
                        pipelined: bool = False) -> list[tuple[bytes, dict[bytes, bytes], bytes]]:
    """Send ``requests`` on one connection, each after the answer before it (or all at once:
    ``pipelined``); the answers as (status line, headers, body). The last request asks for a close,
    and the connection must then end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    if pipelined:
        writer.write(b"".join(requests))
    for req in requests:
        if not pipelined:
            writer.write(req)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head[:-4].split(b"\r\n")
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        out.append((lines[0], headers, await reader.readexactly(int(headers[b"content-length"]))))
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing more
    writer.close()
    return out


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-by-one", "pipelined"])
async def test_a_whole_answer_is_the_same_bytes_from_either_listener(monkeypatch, pipelined):
    """kvroute's listener writes a whole answer's head and body at once (``write_whole``); what the
    client reads must be what uvicorn's two-message path sends: status, the pod's headers, ours, the
    length, and on the request that asks for it ``connection: close`` and a closed connection.
    Pipelined requests take uvicorn's path (an answer goes out in one write only while its request
    is the connection's latest) and must read the same."""
    import router.lifecycle

    written: list[bool] = []
    real = router.lifecycle.write_whole
    monkeypatch.setattr(router.lifecycle, "write_whole", lambda *a: written.append(real(*a)) or written[-1])
    seen = {}
    body = orjson.dumps(completion())

    def req(rid: str, close: bool = False) -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"x-request-id: %s\r\ncontent-length: %d\r\n%s\r\n" % (
                    rid.encode(), len(body), b"connection: close\r\n" if close else b"")) + body

    for name, http in (("uvicorn", "auto"), ("kvroute", GuardedHttpToolsProtocol)):
        async with pods_running(1, fail_status=503, fail_times=1) as pods, \
                running_router(settings_for(pods, retries=0), http) as (base, services):
            port = int(base.rsplit(":", 1)[1])
            answers = await _raw_exchange(port, [req("r1"), req("r2"), req("r3", close=True)], pipelined)
        assert [a[0] for a in answers] == [b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 200 OK",
                                           b"HTTP/1.1 200 OK"], name
        for (_, headers, payload), rid in zip(answers, (b"r1", b"r2", b"r3"), strict=True):
            assert headers[b"x-request-id"] == rid and headers[b"x-kvroute-pod"] == b"pod-0"
            assert int(headers[b"content-length"]) == len(payload)
        assert orjson.loads(answers[1][2])["choices"][0]["text"] == "hi from pod-0"
        assert answers[1][1][b"x-pod-name"] == b"pod-0"
        assert b"connection" not in answers[1][1] and answers[2][1][b"connection"] == b"close"
        seen[name] = [(line, {k: v for k, v in h.items() if k != b"date"}, b) for line, h, b in answers]
    # uvicorn's listener: the two messages; kvroute's: one write, unless a later request is already in
    assert written[:3] == [False] * 3 and (written[3:] == [True] * 3 or pipelined and not all(written[3:]))
    assert seen["kvroute"] == seen["uvicorn"]


async def _read_chunked(reader: asyncio.StreamReader, timeout: float = 10) -> tuple[dict[bytes, bytes], bytes]:
    """One chunked answer off ``reader``: its headers and its body, de-chunked."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head[:-4].split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK", lines[0]
    headers = dict(line.split(b": ", 1) for line in lines[1:])
    assert headers[b"transfer-encoding"] == b"chunked"
    body = b""
    while True:
        size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout))[:-2], 16)
        data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
        assert data[-2:] == b"\r\n"
        if size == 0:
            return headers, body
        body += data[:-2]


def _request(body: dict, close: bool = False) -> bytes:
    raw = orjson.dumps(body)
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n" % (len(raw), b"connection: close\r\n" if close else b"")) + raw


def _texts(body: bytes) -> list[str]:
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]", events[-1][:100]
    return [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]


async def test_a_stream_is_the_same_from_either_listener(monkeypatch):
    """Under kvroute's listener a stream's chunks go from the pod's connection to the client's
    without a task step each (``ChunkWriter``, ``UpstreamResponse.relay_to``); what the client reads
    must be what uvicorn's path sends: the head, every event in order, the last chunk, and a
    connection that then serves the next request."""
    import router.lifecycle

    writers: list[bool] = []
    real = router.lifecycle.chunk_writer
    monkeypatch.setattr(router.lifecycle, "chunk_writer", lambda scope: writers.append(real(scope) is not None)
                        or real(scope))
    seen = {}
    for name, http in (("uvicorn", "auto"), ("kvroute", GuardedHttpToolsProtocol)):
        async with pods_running(1, chunks=6, chunk_delay=0.02) as pods, \
                running_router(settings_for(pods), http) as (base, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
            writer.write(_request(completion(stream=True)))
            headers, body = await _read_chunked(reader)
            writer.write(_request(completion(), close=True))  # the same connection, after the stream
            second = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        assert _texts(body) == [f"t{i} " for i in range(6)], name
        assert headers[b"x-kvroute-pod"] == b"pod-0" and headers[b"content-type"].startswith(b"text/event-stream")
        assert second.startswith(b"HTTP/1.1 200 OK") and b"hi from pod-0" in second, second[:200]
        seen[name] = ({k: v for k, v in headers.items() if k not in (b"date", b"x-request-id")}, body)
    assert writers == [False, True]
    assert seen["kvroute"] == seen["uvicorn"]


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol], ids=["uvicorn-listener", "kvroute-listener"])
async def test_a_client_that_stops_reading_stops_the_relay_and_loses_nothing(http):
    """Flow control: while the client reads nothing the router stops reading the pod, so the pod's
    writes wait (the stream is not buffered in the router); once the client reads, every event
    arrives, in order."""
    chunks = 4000  # ~32 MB: more than the sockets' buffers on the way hold
    async with pods_running(1, chunks=chunks, chunk_bytes=8000) as pods, \
            running_router(settings_for(pods), http) as (base, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]),
                                                       limit=1 << 16)
        writer.write(_request(completion(stream=True), close=True))
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.sleep(0.5)
        stalled = pods[0].written
        await asyncio.sleep(0.5)
        assert pods[0].written == stalled < chunks  # the pod waits for the client
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10))[:-2], 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), 10)
            if size == 0:
                break
            body += data[:-2]
        writer.close()
    texts = _texts(body)
    assert len(texts) == chunks and [t.split(" ", 1)[0] for t in texts] == [f"t{i}" for i in range(chunks)]


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol], ids=["uvicorn-listener", "kvroute-listener"])
async def test_the_read_timeout_bounds_each_gap_of_a_stream_not_the_whole(http):
    """``read_timeout_s`` is the longest silence a pod may keep mid-stream: a stream that takes
    longer in all but never pauses that long is relayed whole; one that stalls ends with an error
    event."""
    async with pods_running(1, chunks=8, chunk_delay=0.1) as pods, \
            running_router(settings_for(pods, read_timeout_s=0.4), http) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            started = time.monotonic()
            r = await c.post("/v1/completions", json=completion(stream=True))
            assert time.monotonic() - started > 0.7  # the whole stream outlasted the timeout
            assert _texts(r.content) == [f"t{i} " for i in range(8)]
            pods[0].stall_s = 1.5
            r = await c.post("/v1/completions", json=completion(stream=True))
        events = [e for e in r.content.split(b"\n\n") if e]
        assert orjson.loads(events[0][6:])["choices"][0]["text"] == "t0 "
        assert events[-1] == b"data: [DONE]" and b"upstream stream failed" in events[-2], events[-2:]
        assert len(events) == 3


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol], ids=["uvicorn-listener", "kvroute-listener"])
async def test_client_disconnect_cancels_the_upstream_request(http):
    async with pods_running(1, hang=True) as pods, running_router(settings_for(pods), http) as (base, services):
        async with aiohttp.ClientSession() as s:
            resp = await s.post(base + "/v1/completions", json=completion(stream=True))
            assert resp.status == 200
            await resp.content.readany()
            resp.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 5
        while pods[0].cancelled == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert pods[0].cancelled == 1
        assert services.router.ledger.inflight("pod-0") == 0
        await asyncio.sleep(0.1)
        assert services.metrics.client_disconnects._value.get() == 1


async def _upstream_cancelled_once(pod: Pod, services) -> None:
    """The pod saw its request cancelled (within 3 s), the booking went, and one disconnect was counted."""
    deadline = time.monotonic() + 3
    while pod.cancelled == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert pod.cancelled == 1
    assert services.router.ledger.inflight(pod.name) == 0
    assert services.metrics.client_disconnects._value.get() == 1


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol], ids=["uvicorn-listener", "kvroute-listener"])
async def test_client_leaving_before_the_first_token_cancels_the_queued_upstream_request(http):
    # under uvicorn's own listener a task polls receive() for the disconnect; under kvroute's the
    # connection's loss cancels the handler's wait itself (kvcommon.asgi.unless_disconnected)
    async with pods_running(1, first_delay=5.0) as pods, running_router(settings_for(pods), http) as (base, services):
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(base + "/v1/completions", json=completion(stream=True),
                             timeout=aiohttp.ClientTimeout(total=0.3))
        await _upstream_cancelled_once(pods[0], services)


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol], ids=["uvicorn-listener", "kvroute-listener"])
async def test_client_leaving_mid_body_of_a_whole_answer_closes_the_upstream_request(http):
    # the pod sends its head and half its body, then stalls: the read of the rest was not watched, so
    # the router held the pod's request open until the pod finished (or for ever)
    async with pods_running(1, trickle=True) as pods, running_router(settings_for(pods), http) as (base, services):
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                resp = await s.post(base + "/v1/completions", json=completion(),
                                    timeout=aiohttp.ClientTimeout(total=0.5))
                await resp.read()
        await _upstream_cancelled_once(pods[0], services)


async def test_a_pod_that_cannot_be_reached_is_named_by_id_not_by_address():
    # the connect error's detail names the pod's host and port: a client gets what failed, not where
    async with pods_running(1) as pods, running_router(settings_for(pods, health_interval_s=30)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            assert (await c.post("/v1/completions", json=completion())).status_code == 200
            await pods[0].stop()
            r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert "pod-0 could not be reached (connect)" in message
        assert "127.0.0.1" not in r.text and str(pods[0].port) not in r.text


async def test_5xx_before_first_byte_is_retried_once_on_the_next_pod():
    async with pods_running(2, fail_status=503) as pods, running_router(settings_for(pods)) as (base, services):
        async with httpx.AsyncClient(base_url=base) as c:
            first = (await c.post("/debug/route", json=completion(stream=True))).json()["chosen"]
            by_name = {p.name: p for p in pods}
            by_name[first].fail_times = 1
            r = await c.post("/v1/completions", json=completion(stream=True))
        assert r.status_code == 200
        assert all(len(p.seen) == 1 for p in pods)  # the first pod failed, the second answered
        assert r.headers["x-kvroute-pod"] != first
        assert services.metrics.retries.labels("5xx")._value.get() == 1
        assert services.router.ledger.inflight(first) == 0
        # both pods failing: the client gets the last pod's error, after exactly one retry
        for p in pods:
            p.fail_times, p.seen = 5, []
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 503 and r.json()["error"]["message"] == "boom"
        assert sum(len(p.seen) for p in pods) == 2
        # relayed with the pod's own headers, plus which pod and the request id, each once
        assert r.headers["content-type"].startswith("application/json")
        assert r.headers["x-kvroute-pod"] in by_name and r.headers["x-request-id"]
        assert len(r.headers.get_list("x-kvroute-pod")) == len(r.headers.get_list("content-length")) == 1


async def test_a_retry_skips_pods_that_went_unhealthy_after_the_ranking():
    # the ranking is made before the first try; pods marked down while that try was queued on its pod
    # are not retried (they were, from the stale ranking)
    async with pods_running(3, fail_status=503, first_delay=0.5) as pods, \
            running_router(settings_for(pods, health_interval_s=30)) as (base, services):
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            first = (await c.post("/debug/route", json=completion())).json()["chosen"]
            by_name = {p.name: p for p in pods}
            by_name[first].fail_times = 1
            sent = asyncio.create_task(c.post("/v1/completions", json=completion()))
            while not by_name[first].seen:
                await asyncio.sleep(0.02)
            for name in by_name.keys() - {first}:
                services.registry.pods[name].healthy = False
            r = await sent
        assert r.status_code == 503 and r.json()["error"]["message"] == "boom", r.text
        assert [len(p.seen) for p in pods if p.name != first] == [0, 0]
        assert all(services.router.ledger.inflight(p.name) == 0 for p in pods)


async def test_connection_failure_is_retried_and_marks_the_pod():
    async with pods_running(1) as pods:
        dead_port = free_port()
        fleet = [{"id": "dead", "url": f"http://127.0.0.1:{dead_port}", "model": "m"},
                 {"id": "alive", "url": pods[0].url, "model": "m"}]
        settings = build_settings(RouterSettings, {"pods": fleet, "port": free_port(), "health_interval_s": 30,
                                                   "unhealthy_after": 5, "policy": "round-robin"})
        async with running_router(settings) as (base, services):
            services.registry.mark("dead", True)  # pretend it was healthy at the last check
            async with httpx.AsyncClient(base_url=base) as c:
                codes = [(await c.post("/v1/completions", json=completion())) for _ in range(2)]
            assert [r.status_code for r in codes] == [200, 200]
            assert {r.headers["x-kvroute-pod"] for r in codes} == {"alive"}
            assert services.metrics.retries.labels("connect")._value.get() == 1
            assert services.registry.pods["dead"].failures >= 1


async def test_api_keys_are_required_when_configured():
    async with pods_running(1) as pods, running_router(settings_for(pods, api_keys=["k1", "k2"])) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/v1/completions", json=completion())
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            r = await c.post("/v1/completions", json=completion(), headers={"authorization": "Bearer nope"})
            assert r.status_code == 401
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.post("/debug/route", json=completion())).status_code == 401
            r = await c.post("/v1/completions", json=completion(), headers={"authorization": "Bearer k2"})
            assert r.status_code == 200
            assert "authorization" not in {k.lower() for k in pods[0].seen[-1]["headers"]}
            assert (await c.get("/health")).status_code == 200
        assert len(pods[0].seen) == 1


async def test_bad_requests_get_openai_errors_and_touch_no_pod():
    async with pods_running(1) as pods, running_router(settings_for(pods, max_body_bytes=1000)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            cases = [
                (await c.post("/v1/completions", content=b"{not json"), 400),
                (await c.post("/v1/completions", content=b"[1,2]"), 400),
                (await c.post("/v1/completions", content=b""), 400),
                (await c.post("/v1/completions", json={"model": "m"}), 400),
                (await c.post("/v1/completions", json={"model": "m", "prompt": [1, "a"]}), 400),
                (await c.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404),
                (await c.post("/v1/completions", json={"model": 3, "prompt": "x"}), 400),
                (await c.post("/v1/completions", json=completion(stream="yes")), 400),
                (await c.post("/v1/chat/completions", json={"model": "m", "messages": "hi"}), 400),
                (await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"content": "x"}]}), 400),
                (await c.post("/v1/completions", json=completion(prompt="x" * 2000)), 413),
                (await c.post("/v1/completions", json=completion(), headers={"x-slo-ttft-ms": "soon"}), 400),
                (await c.get("/v1/completions"), 405),
                (await c.get("/nowhere"), 404),
            ]
        for r, status in cases:
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["code"] == status and isinstance(err["message"], str) and err["type"]
        assert pods[0].seen == []


async def test_no_healthy_pod_gives_503_not_a_hang():
    dead = [{"id": "dead", "url": f"http://127.0.0.1:{free_port()}", "model": "m"}]
    settings = build_settings(RouterSettings, {"pods": dead, "port": free_port(), "health_timeout_s": 0.2})
    async with running_router(settings) as (base, services):
        async with httpx.AsyncClient(base_url=base) as c:
            assert (await c.get("/ready")).status_code == 503
            r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 503 and "no healthy pod" in r.json()["error"]["message"]
        assert services.metrics.rejections.labels("no-pods")._value.get() == 1


async def test_admission_rejects_with_429_before_any_pod_is_touched():
    # a tiny prefill rate makes a 2,000-token prompt take 2 s anywhere
    async with (pods_running(2) as pods,
                running_router(settings_for(pods, prefill_tokens_per_s=1000.0, calibrate=False)) as (base, services)):
        prompt = "a" * 2000
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post("/v1/completions", json=completion(prompt=prompt), headers={"x-slo-ttft-ms": "500"})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "RateLimitError"
            assert r.json()["error"]["code"] == 429 and "objective" in r.json()["error"]["message"]
            assert all(not p.seen for p in pods)
            # the priority header exempts critical traffic
            r = await c.post("/v1/completions", json=completion(prompt=prompt),
                             headers={"x-slo-ttft-ms": "500", "x-priority": "critical"})
            assert r.status_code == 200
            # a lenient objective admits
            r = await c.post("/v1/completions", json=completion(prompt=prompt), headers={"x-slo-ttft-ms": "5000"})
            assert r.status_code == 200
        assert services.metrics.rejections.labels("slo")._value.get() == 1


async def test_configured_objective_applies_without_a_header():
    async with pods_running(1) as pods, running_router(settings_for(pods, prefill_tokens_per_s=1000.0, calibrate=False,
                                                                    ttft_objective_ms=100)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            assert (await c.post("/v1/completions", json=completion(prompt="a" * 500))).status_code == 429
            assert (await c.post("/v1/completions", json=completion(prompt="a" * 20))).status_code == 200


async def test_debug_route_agrees_with_the_real_decision():
    async with pods_running(3) as pods, running_router(settings_for(pods, calibrate=False)) as (base, services):
        prompts = [f"session {i} " + "shared system prompt " * 20 + f"turn {i}" for i in range(6)]
        async with httpx.AsyncClient(base_url=base) as c:
            for p in prompts + prompts[:3]:
                body = completion(prompt=p)
                explained = (await c.post("/debug/route", json=body)).json()
                assert explained["admitted"] and len(explained["pods"]) == 3
                assert {row["verdict"] for row in explained["pods"]} == {"chosen", "candidate"}
                chosen_row = next(row for row in explained["pods"] if row["verdict"] == "chosen")
                assert chosen_row["predicted_ttft_ms"] == min(row["predicted_ttft_ms"] for row in explained["pods"])
                real = await c.post("/v1/completions", json=body)
                assert real.headers["x-kvroute-pod"] == explained["chosen"]
        # the debug calls sent nothing anywhere
        assert sum(len(p.seen) for p in pods) == len(prompts) + 3


async def test_debug_route_shows_the_cached_prefix_after_a_route():
    async with pods_running(2) as pods, running_router(settings_for(pods)) as (base, _):
        body = completion(prompt="p" * 160)  # 10 blocks of 16 byte-tokens
        async with httpx.AsyncClient(base_url=base) as c:
            first = await c.post("/v1/completions", json=body)
            explained = (await c.post("/debug/route", json=body)).json()
        row = next(r for r in explained["pods"] if r["pod"] == first.headers["x-kvroute-pod"])
        assert row["cached_tokens"] == 160 and row["uncached_tokens"] == 1
        assert explained["chosen"] == first.headers["x-kvroute-pod"]


async def test_openai_sdk_works_through_the_router():
    import openai

    async with pods_running(2, chunks=3) as pods, running_router(settings_for(pods, api_keys=["sk-test"])) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
        done = await client.completions.create(model="m", prompt="hello", max_tokens=2)
        assert done.choices[0].text.startswith("hi from pod-")
        stream = await client.completions.create(model="m", prompt="hello", max_tokens=3, stream=True)
        texts = [chunk.choices[0].text async for chunk in stream]
        assert texts == ["t0 ", "t1 ", "t2 "]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="missing", prompt="x", max_tokens=1)
        bad = openai.AsyncOpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model="m", prompt="x", max_tokens=1)
        await client.close()
        await bad.close()


async def test_every_booking_is_released_exactly_once_whichever_way_the_request_ends(monkeypatch):
    from router.booking import Booking

    releases: dict[int, int] = {}
    kept: list[Booking] = []  # held to the end: a freed booking's id() could be a later booking's
    original = Booking.release

    def counting(self, ledger):
        first = original(self, ledger)
        kept.append(self)
        releases[id(self)] = releases.get(id(self), 0) + (1 if first else 0)
        return first

    monkeypatch.setattr(Booking, "release", counting)
    async with pods_running(2, chunks=2) as pods, running_router(settings_for(pods, retries=1)) as (base, services):
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            assert (await c.post("/v1/completions", json=completion())).status_code == 200
            assert (await c.post("/v1/completions", json=completion(stream=True))).status_code == 200
            pods[0].fail_status, pods[0].fail_times = 503, 1
            pods[1].fail_status, pods[1].fail_times = 503, 1
            assert (await c.post("/v1/completions", json=completion(prompt="retried"))).status_code == 503
            pods[0].first_delay = pods[1].first_delay = 5.0
        async with aiohttp.ClientSession() as s:  # a client that leaves before the first token
            with pytest.raises(asyncio.TimeoutError):
                await s.post(base + "/v1/completions", json=completion(stream=True),
                             timeout=aiohttp.ClientTimeout(total=0.3))
        deadline = time.monotonic() + 5
        while sum(p.cancelled for p in pods) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        # 1 + 1 + 2 (a 5xx on both pods) + 1 bookings, each released once, and nothing left booked
        assert sorted(releases.values()) == [1] * 5, releases
        assert services.router.ledger.empty()
        text = (await httpx.AsyncClient(base_url=base).get("/metrics")).text
        assert 'status="499"} 1.0' in text and 'status="503"} 1.0' in text


async def test_a_custom_scorer_list_routes_and_is_labelled_custom():
    async with pods_running(2) as pods:
        pods[0].waiting = 7  # a queue the router did not send: the load scorer avoids pod-0
        settings = settings_for(pods, scorers=[{"type": "load", "weight": 2.0}, {"type": "cache", "weight": 0.5}])
        async with running_router(settings) as (base, services):
            async with httpx.AsyncClient(base_url=base) as c:
                await asyncio.sleep(0.3)  # a scrape
                explained = (await c.post("/debug/route", json=completion())).json()
                assert explained["policy"] == "custom" and explained["chosen"] == "pod-1"
                r = await c.post("/v1/completions", json=completion())
                assert r.headers["x-kvroute-pod"] == "pod-1"
                assert 'policy="custom",status="200"} 1.0' in (await c.get("/metrics")).text


async def test_each_first_token_is_checked_against_the_predicted_interval():
    async with pods_running(2, chunks=1) as pods, running_router(settings_for(pods)) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            explained = (await c.post("/debug/route", json=completion(), headers={"x-slo-ttft-ms": "500"})).json()
            for p in explained["pods"]:
                low, high = p["ttft_interval_90_ms"]
                assert low < p["predicted_ttft_ms"] < high and 0.0 <= p["miss_probability"] < 0.5
            assert explained["best_miss_probability"] < 0.5
            for _ in range(5):
                assert (await c.post("/v1/completions", json=completion(stream=True))).status_code == 200
            text = (await c.get("/metrics")).text
        counts = {o: float(re.search(rf'kvroute_ttft_interval_total{{outcome="{o}"}} (\S+)', text).group(1))
                  for o in ("inside", "below", "above") if f'outcome="{o}"' in text}
        assert sum(counts.values()) == 5, counts  # every streamed first token, and only those


async def test_a_long_prompts_credit_is_given_in_pieces_over_loop_turns(monkeypatch):
    """Crediting a cold 32k-token prompt's 2,000 blocks in one piece held the event loop for 2-5 ms:
    on the loop the first piece goes at once and the rest in the turns that follow, CREDIT_NOW_BLOCKS
    a turn, and LONG_CREDIT_PIECE a turn for a credit of more than LONG_CREDIT_BLOCKS; off the loop
    (``kvroute simulate``) all at once. Another router process's credit (the booking bus) goes the
    same way."""
    import asyncio

    from router import routing
    from router.routing import CREDIT_NOW_BLOCKS, LONG_CREDIT_PIECE

    async with pods_running(1) as pods:
        async with running_router(settings_for(pods)) as (_, services):
            r = services.router
            n = 2 * CREDIT_NOW_BLOCKS + 40

            def held(keys: list[int]) -> int:
                got = r.index.match(keys, ["pod-0"]).get("pod-0")
                return got.blocks if got else 0

            # the bound lowered under this pod's 1,000 KV blocks, past which its oldest credits would go
            monkeypatch.setattr(routing, "LONG_CREDIT_BLOCKS", 600)
            assert n <= routing.LONG_CREDIT_BLOCKS
            for start, credit in ((7_000_000, r.speculate), (11_000_000, r.credit_foreign)):
                r.index.clear_pod("pod-0")
                keys = [start + i for i in range(n)]
                credit("pod-0", keys)
                assert held(keys) == CREDIT_NOW_BLOCKS
                for _ in range(3):
                    await asyncio.sleep(0)
                assert held(keys) == n
                r.index.clear_pod("pod-0")
                long = [start + 1_000_000 + i for i in range(routing.LONG_CREDIT_BLOCKS + 1)]
                credit("pod-0", long)
                depths = [held(long)]
                for _ in range(len(long) // LONG_CREDIT_PIECE + 1):
                    await asyncio.sleep(0)
                    depths.append(held(long))
                assert depths[:3] == [LONG_CREDIT_PIECE * k for k in (1, 2, 3)], depths
                assert depths[-1] == len(long), depths
            r.index.clear_pod("pod-0")
            other = [9_000_000 + i for i in range(n)]
            await asyncio.to_thread(r.speculate, "pod-0", other)  # no running loop there: all at once
            assert held(other) == len(other)


async def test_a_request_for_prompt_logprobs_is_credited_no_cached_prefix():
    """vLLM reads no cached KV for a request that asks for prompt logprobs (``prompt_logprobs``, a
    completion's ``echo`` with ``logprobs``, a chat completion's ``echo``: its sampling params'
    ``skip_reading_prefix_cache``): its prefill is the whole prompt on every pod, so the router
    predicts it so. Its blocks are still booked to the pod that computes them."""
    prompt = "The same long prompt, sent again and again. " * 40
    async with pods_running(2) as pods, running_router(settings_for(pods, block_size=16)) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            r = await c.post("/v1/completions", json=completion(prompt=prompt, max_tokens=2,
                                                                   prompt_logprobs=1))
            assert r.status_code == 200, r.text
            held = r.headers["x-kvroute-pod"]

            def cached(explained: dict) -> dict[str, int]:
                return {p["pod"]: p["cached_tokens"] for p in explained["pods"]}

            plain = (await c.post("/debug/route", json=completion(prompt=prompt))).json()
            assert cached(plain)[held] >= 400  # the first request's blocks were booked to its pod
            for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 0}, {"echo": "yes", "logprobs": 2}):
                explained = (await c.post("/debug/route", json=completion(prompt=prompt, **extra))).json()
                assert set(cached(explained).values()) == {0}, (extra, explained["pods"])
                assert explained["prompt_tokens"] == plain["prompt_tokens"]
            # echo without logprobs on a completion computes no prompt logprobs: the prefix counts
            echoed = (await c.post("/debug/route", json=completion(prompt=prompt, echo=True))).json()
            assert cached(echoed)[held] == cached(plain)[held]
            chat = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
            await c.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
            assert max(cached((await c.post("/debug/route", json=chat)).json()).values()) > 0
            assert set(cached((await c.post("/debug/route", json={**chat, "echo": True})).json()).values()) == {0}


async def test_the_pod_gets_the_clients_address_last_in_x_forwarded_for():
    """A client's own X-Forwarded-For went to the pod as it was written: vLLM's uvicorn trusts the
    header from its loopback (behind a sidecar) and logged the address the client chose. The router
    appends the address the request came from, as a proxy does, so the last entry is the real one
    (without one the router adds none: the pod sees the connection's own address)."""
    # as kvroute serve runs by default: no uvicorn middleware rewriting the client's address from the header
    async with pods_running(1) as pods, running_router(settings_for(pods), proxy_headers=False) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            r = await c.post("/v1/completions", json=completion(), headers={"x-forwarded-for": "203.0.113.9"})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", json=completion())
            assert r.status_code == 200, r.text
    assert [s["headers"].get("x-forwarded-for") for s in pods[0].seen] == ["203.0.113.9, 127.0.0.1", None]
