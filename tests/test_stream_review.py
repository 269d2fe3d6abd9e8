"""Review of how the router relays streamed (SSE) answers: loopback pods that stream in one exact way
each, a real OpenAI client in front of the router.

- a stream that opens with SSE comment lines (vLLM's ``--sse-keep-alive-interval`` sends
  ``: keep-alive`` while a request waits or prefills) has not produced its first token yet: the
  router's TTFT is taken at the first event, not at the comment, and the comment still reaches the
  client at once;
- a pod that drops the stream between two events: the client's SDK raises the router's error
  event, and the request counts as a 502 (no fix needed: a regression test);
- the same on the Anthropic Messages route, with Anthropic's SDK, which skips an event with no name:
  the router's error event there is vLLM's ``event: error`` (the OpenAI one ended the client's
  stream as if it were whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvcommon.listener import GuardedHttpToolsProtocol
from tests.test_router_api import running_router, settings_for
from tests.test_upstream_review import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
         b'"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n')


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def ttft_observations(services) -> tuple[float, float]:
    """(sum, count) of kvroute_observed_ttft_seconds."""
    samples = {s.name: s.value for m in services.metrics.observed_ttft.collect() for s in m.samples}
    return samples["kvroute_observed_ttft_seconds_sum"], samples["kvroute_observed_ttft_seconds_count"]


def answering(server_ref: list[Server], stream: Callable[[asyncio.StreamWriter], Awaitable[None]]):
    async def handler(reader, writer, n):
        while True:
            line, _ = await server_ref[0].read_request(reader)
            if line.startswith(b"GET "):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            await stream(writer)
    return handler


@contextlib.asynccontextmanager
async def router_before_a_pod_that_dies(data: bytes, http: Any = GuardedHttpToolsProtocol):
    """The router (``http``: its listener) in front of one raw pod that answers every request with
    ``data`` and then dies (its connection reset: no ``[DONE]``, no last chunk); yields (base, services)."""
    async def stream(writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.transport.abort()

    ref: list[Server] = []
    async with Server(answering(ref, stream)) as server:
        ref.append(server)
        pod = type("P", (), {"name": "raw", "url": f"http://127.0.0.1:{server.port}"})()
        async with running_router(settings_for([pod], retries=0), http=http) as running:
            yield running


@pytest.mark.parametrize("data", [b": keep-alive\n\n", b":\r\n\r\n", b": a comment\n: another\n\n"])
def test_first_event_begins_skips_comment_lines(data):
    from router.dispatch import first_event_begins

    assert first_event_begins(data)[0] is False
    assert first_event_begins(data + EVENT)[0] is True
    assert first_event_begins(EVENT)[0] is True
    # a comment line split across reads: its rest is no event
    found, in_comment = first_event_begins(data[:1])
    assert (found, in_comment) == (False, True)
    assert first_event_begins(data[1:], in_comment) == (False, False)
    assert first_event_begins(b"ive\n\n" + EVENT, True)[0] is True


@pytest.mark.parametrize("listener", ["uvicorn", "kvroute"])
async def test_a_keep_alive_comment_before_the_first_token_is_no_first_token(listener):
    wait_s = 0.6

    async def stream(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(b": keep-alive\n\n"))
        await writer.drain()
        await asyncio.sleep(wait_s)  # the request waits or prefills: vLLM sends a keep-alive comment
        writer.write(chunk(EVENT) + chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    ref: list[Server] = []
    async with Server(answering(ref, stream)) as server:
        ref.append(server)
        pod = type("P", (), {"name": "raw", "url": f"http://127.0.0.1:{server.port}"})()
        http = GuardedHttpToolsProtocol if listener == "kvroute" else "auto"
        async with running_router(settings_for([pod], retries=0), http=http) as (base, services):
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=10)
            t0 = time.monotonic()
            texts, first_at = [], None
            response = await client.completions.with_raw_response.create(model="m", prompt="hi", max_tokens=2,
                                                                          stream=True)
            async for part in response.parse():
                if first_at is None:
                    first_at = time.monotonic() - t0
                texts.append(part.choices[0].text)
            await client.close()
            total, count = ttft_observations(services)
    assert texts == ["a", "a"] and first_at is not None and first_at >= wait_s
    assert count == 1
    # before: the keep-alive comment was taken for the first token (0.00 s observed against 0.6 s)
    assert total >= wait_s * 0.9, f"observed TTFT {total:.3f} s, first event after {first_at:.3f} s"


async def test_the_keep_alive_comment_is_relayed_at_once():
    """The comment keeps the client's own proxies from timing the stream out: it goes on before the
    first token, as the pod sent it."""
    release = asyncio.Event()

    async def stream(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(b": keep-alive\n\n"))
        await writer.drain()
        await asyncio.wait_for(release.wait(), 10)
        writer.write(chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    ref: list[Server] = []
    async with Server(answering(ref, stream)) as server:
        ref.append(server)
        pod = type("P", (), {"name": "raw", "url": f"http://127.0.0.1:{server.port}"})()
        async with running_router(settings_for([pod], retries=0), http=GuardedHttpToolsProtocol) as (base, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
            body = b'{"model": "m", "prompt": "hi", "max_tokens": 1, "stream": true}'
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(body), body))
            await writer.drain()
            got = b""
            try:
                async with asyncio.timeout(5):
                    while b": keep-alive" not in got:
                        data = await reader.read(65536)
                        assert data, got
                        got += data
            finally:
                release.set()
                writer.close()
    assert b"text/event-stream" in got


async def test_a_pod_that_drops_the_stream_between_events_leaves_the_client_a_readable_error():
    async with router_before_a_pod_that_dies(SSE_HEAD + chunk(EVENT) + chunk(EVENT)) as (base, services):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=10)
        texts = []
        with pytest.raises(openai.APIError) as failed:
            async for part in await client.completions.create(model="m", prompt="hi", max_tokens=9, stream=True):
                texts.append(part.choices[0].text)
        await client.close()
        answered = {s.labels["status"]: s.value for m in services.metrics.requests.collect() for s in m.samples
                    if s.name.endswith("_total")}
    assert texts == ["a", "a"]
    assert "upstream stream failed" in str(failed.value)
    assert answered == {"502": 1}


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol])
@pytest.mark.parametrize("cut", [len(EVENT) // 2, len(EVENT) - 1, 6])
async def test_a_pod_that_drops_the_stream_inside_an_event_leaves_the_client_a_readable_error(http, cut):
    """The pod's last bytes end inside an event: the client gets the events before it whole and then
    the router's error event, never the half event run into the error (the SDK would raise a JSON
    error on the mixture, not the router's message). Under both listeners (the relay's two paths)."""
    async with router_before_a_pod_that_dies(SSE_HEAD + chunk(EVENT) + chunk(EVENT[:cut]), http=http) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=10)
        texts = []
        with pytest.raises(openai.APIError) as failed:
            async for part in await client.completions.create(model="m", prompt="hi", max_tokens=9, stream=True):
                texts.append(part.choices[0].text)
        await client.close()
    assert texts == ["a"]
    assert "upstream stream failed" in str(failed.value)


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol])
async def test_a_last_event_without_its_blank_line_still_reaches_the_client(http):
    """Holding back an unfinished event (above) must not lose a stream's last one when the pod ends
    the stream without the blank line after it: it goes out as it came, at the stream's end."""
    async def stream(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(EVENT) + chunk(b"data: [DONE]") + chunk(b"\n") + b"0\r\n\r\n")
        await writer.drain()

    ref: list[Server] = []
    async with Server(answering(ref, stream)) as server:
        ref.append(server)
        pod = type("P", (), {"name": "raw", "url": f"http://127.0.0.1:{server.port}"})()
        async with running_router(settings_for([pod], retries=0), http=http) as (base, _), \
                httpx.AsyncClient(base_url=base, timeout=10) as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
    assert r.status_code == 200 and r.content == EVENT + b"data: [DONE]\n"


async def test_the_simulated_pods_keep_alive_comments_are_relayed_and_time_no_token():
    """The simulated pod sends vLLM's ``: keep-alive`` comments (``--sse-keep-alive-interval``) while a
    long prompt prefills: the client gets them before the first event, and the router's TTFT is the
    pod's first token (its ``x-sim-ttft-s``), not the first comment."""
    from kvcommon.settings import build_settings
    from router.config import RouterSettings
    from simulator.testing import running_sims
    from tests.helpers import free_port

    with running_sims(1, ["--timing", "seed", "--prefill-tokens-per-s", "4000", "--sse-keep-alive-interval", "0.05",
                          "--block-size", "16"]) as urls:
        settings = build_settings(RouterSettings, {"pods": [{"id": "sim-0", "url": urls[0], "model": "sim-model"}],
                                                   "port": free_port(), "retries": 0})
        async with running_router(settings) as (base, services), httpx.AsyncClient(base_url=base, timeout=30) as c:
            body = {"model": "sim-model", "prompt": list(range(1, 2001)), "max_tokens": 3, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                raw = b"".join([part async for part in r.aiter_bytes()])
            total, count = ttft_observations(services)
    events = [e for e in raw.split(b"\n\n") if e]
    comments = next(i for i, e in enumerate(events) if not e.startswith(b":"))
    assert comments >= 3 and all(e == b": keep-alive" for e in events[:comments]), events[:comments + 1]
    assert events[-1] == b"data: [DONE]" and count == 1
    assert total >= 0.4, f"observed TTFT {total:.3f} s; the 2,000-token prompt prefills for ~0.5 s"


MESSAGE_EVENTS = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-1","type":"message",'
                  b'"role":"assistant","content":[],"model":"m","usage":{"input_tokens":9,"output_tokens":0}}}\n\n'
                  b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
                  b'"content_block":{"type":"text","text":""}}\n\n')
MESSAGE_DELTA = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                 b'"delta":{"type":"text_delta","text":"a"}}\n\n')


@pytest.mark.parametrize("http", ["auto", GuardedHttpToolsProtocol])
@pytest.mark.parametrize("cut", [0, len(MESSAGE_DELTA) // 2])
async def test_a_broken_messages_stream_raises_the_routers_error_in_anthropics_sdk(http, cut):
    """vLLM's Messages stream breaks after a text delta (between events, or inside the next one):
    Anthropic's SDK raises the router's message, as it does vLLM's own ``event: error``, and the
    events before the break arrive whole."""
    half = chunk(MESSAGE_DELTA[:cut]) if cut else b""  # (a chunk of nothing would end the body)
    data = SSE_HEAD + chunk(MESSAGE_EVENTS) + chunk(MESSAGE_DELTA) + half
    async with router_before_a_pod_that_dies(data, http=http) as (base, services):
        client = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0, timeout=10)
        kinds, texts = [], []
        with pytest.raises(anthropic.APIError) as failed:
            async for event in await client.messages.create(
                    model="m", max_tokens=9, stream=True, messages=[{"role": "user", "content": "hi"}]):
                kinds.append(event.type)
                if event.type == "content_block_delta":
                    texts.append(event.delta.text)
        await client.close()
        answered = {s.labels["status"]: s.value for m in services.metrics.requests.collect() for s in m.samples
                    if s.name.endswith("_total")}
    assert kinds == ["message_start", "content_block_start", "content_block_delta"] and texts == ["a"]
    assert "upstream stream failed" in str(failed.value) and "internal_error" in str(failed.value)
    assert answered == {"502": 1}
