"""The pod answer headers a tenant sees through the router (``router.dispatch.response_headers``):
never a header the pod's own ``Connection`` names (hop-by-hop, RFC 9110 7.6.1); every other header
of the pod's goes on, the sidecar's report of the request's own prefill leg (``x-kvroute-prefill``/
``-ms``) included. A raw loopback pod writes exactly the bytes each test needs."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from kvcommon.settings import build_settings
from router.config import RouterSettings
from router.dispatch import response_headers
from tests.helpers import free_port
from tests.test_router_api import running_router

METRICS = (b'vllm:num_requests_waiting{model_name="m",engine="0"} 0\n'
           b'vllm:num_requests_running{model_name="m",engine="0"} 0\n'
           b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')
ANSWER = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"length"}]}'
STREAM = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"hi"}]}\n\ndata: [DONE]\n\n'


class RawPod:
    """A loopback pod answering /health and /metrics plainly and every POST with ``status`` and the
    header lines ``extra`` (raw bytes, as a pod might write them), JSON or, for a stream, SSE."""

    def __init__(self, extra: bytes, status: bytes = b"200 OK"):
        self.extra, self.status = extra, status

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(1000):   # requests on one keep-alive connection
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                if head.startswith(b"GET /metrics"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(METRICS), METRICS))
                elif head.startswith(b"GET "):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                elif b'"stream":true' in body.replace(b" ", b""):
                    chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(STREAM), STREAM)
                    writer.write(b"HTTP/1.1 " + self.status + b"\r\ncontent-type: text/event-stream\r\n" + self.extra
                                 + b"transfer-encoding: chunked\r\n\r\n" + chunk)
                else:
                    writer.write(b"HTTP/1.1 " + self.status + b"\r\ncontent-type: application/json\r\n" + self.extra
                                 + b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self):
        port = free_port()
        server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()


@contextlib.asynccontextmanager
async def router_before(extra: bytes, status: bytes = b"200 OK"):
    async with RawPod(extra, status).running() as url:
        settings = build_settings(RouterSettings, {"pods": [{"id": "raw", "url": url, "model": "m"}],
                                                   "port": free_port(), "retries": 0})
        async with running_router(settings) as (base, _), httpx.AsyncClient(base_url=base, timeout=10) as c:
            yield c


SIDECAR = b"x-kvroute-prefill: remote\r\nx-kvroute-prefill-ms: 12.5\r\nx-pod-note: kept\r\n"
HOP = (b"Connection: keep-alive, X-Hop-One\r\nconnection: x-hop-two\r\n"
       b"X-Hop-One: a\r\nx-hop-two: b\r\nx-pod-note: kept\r\n")


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_sidecars_report_of_the_requests_own_prefill_leg_is_relayed(stream):
    async with router_before(SIDECAR) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream})
    assert r.status_code == 200, r.text
    assert r.headers["x-pod-note"] == "kept" and r.headers["x-kvroute-pod"] == "raw"
    assert r.headers["x-kvroute-prefill"] == "remote" and r.headers["x-kvroute-prefill-ms"] == "12.5"


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_headers_the_pods_connection_names_are_not_relayed(stream):
    async with router_before(HOP) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream})
    assert r.status_code == 200, r.text
    assert r.headers["x-pod-note"] == "kept"
    assert "x-hop-one" not in r.headers and "x-hop-two" not in r.headers, dict(r.headers)


@pytest.mark.e2e
async def test_a_failed_pods_answer_is_relayed_without_its_hop_by_hop_headers():
    """The last pod's 5xx goes to the client as the pod wrote it (no retry left): filtered the same way."""
    async with router_before(SIDECAR + HOP, status=b"503 Service Unavailable") as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503
    assert r.headers["x-pod-note"] == "kept, kept"
    for name in ("x-hop-one", "x-hop-two"):
        assert name not in r.headers, dict(r.headers)


class _Resp:
    def __init__(self, raw: list[tuple[bytes, bytes]]):
        self.headers = type("H", (), {"raw": raw})()


def test_a_plain_connection_header_drops_nothing_else():
    """keep-alive or close name no header; the rest is relayed in order, repeats included."""
    raw = [(b"connection", b"close"), (b"content-type", b"application/json"), (b"x-a", b"1"), (b"x-a", b"2"),
           (b"date", b"now"), (b"connection", b"Keep-Alive")]
    assert response_headers(_Resp(raw)) == [(b"content-type", b"application/json"), (b"x-a", b"1"), (b"x-a", b"2")]
    named = raw + [(b"connection", b" X-A ,keep-alive")]
    assert response_headers(_Resp(named)) == [(b"content-type", b"application/json")]
