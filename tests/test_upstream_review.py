"""Protocol review of the router's upstream HTTP/1.1 client (router/upstream.py): raw loopback servers
that misbehave in one exact way each, and what the client (or the whole router) makes of it.

- bytes past a whole answer (a second answer in the same read, or junk in a later one) are neither
  appended to the answer nor fail it; the connection is dropped, not reused;
- a chunked answer's trailer fields are not merged into its head (RFC 9110 6.5.1);
- a head that never ends (one endless header, endless interim answers) is bounded like a whole one;
- a body ended by the connection's close under a non-chunked transfer coding is read to the end;
- a reused connection that the pod drops after it had the request for a while is not retried (the
  pod may have worked on it); one dropped as the request was written still is;
- the pool wakes the waiter a freed connection serves, passes a wake-up on when its waiter was
  cancelled, and under the limit in all closes an idle connection to another pod to make room.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvcommon.listener import GuardedHttpToolsProtocol
from router.dispatch import upstream_headers
from router.upstream import STALE_CLOSE_S, PodIOError, UpstreamClient
from tests.test_router_api import running_router, settings_for
from tests.test_upstream import Server as PlainServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server(PlainServer):
    """tests/test_upstream.py's loopback server; it also records each request body it reads
    (``read_request``, which answers the request line and the body)."""

    def __init__(self, handler: Handler):
        super().__init__(handler)
        self.bodies: list[bytes] = []

    async def read_request(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:  # type: ignore[override]
        """(request line, body)."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.bodies.append(body)
        return head.split(b"\r\n", 1)[0], body


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra + \
        b"content-length: %d\r\n\r\n" % len(body) + body


def serving(server_ref: list[Server], replies: list[bytes]) -> Handler:
    """Each request on any connection gets the next of ``replies`` (the last one repeats)."""
    async def handler(reader, writer, n):
        while True:
            await server_ref[0].read_request(reader)
            writer.write(replies.pop(0) if len(replies) > 1 else replies[0])
            await writer.drain()
    return handler


async def fetch(client: UpstreamClient, url: str, body: bytes = b"{}") -> tuple[int, list, bytes]:
    resp = await client.post(url, body, {"content-type": "application/json"})
    data = await resp.read()
    resp.release()
    return resp.status, resp.headers.raw, data


# ---- bytes past the answer ----------------------------------------------------------------------

async def test_a_second_answer_in_the_same_read_is_not_appended_to_the_first_and_the_connection_is_dropped():
    ref: list[Server] = []
    async with Server(serving(ref, [answer(b"first") + answer(b"second"), answer(b"third")])) as server:
        ref.append(server)
        client = UpstreamClient()
        status, raw, data = await fetch(client, server.url)
        # before: b"firstsecond", with both answers' content-length in the head, and the connection reused
        assert (status, data) == (200, b"first")
        assert [v for k, v in raw if k == b"content-length"] == [b"5"]
        assert (await fetch(client, server.url))[2] == b"third"
        assert server.connections == 2
        await client.close()


async def test_bytes_after_a_whole_answer_keep_the_answer_and_drop_the_connection():
    junk_sent = asyncio.Event()

    async def handler(reader, writer, n):
        await server.read_request(reader)
        writer.write(answer(b"abc"))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"junk")
        await writer.drain()
        junk_sent.set()
        await reader.read()  # until the client closes

    async with Server(handler) as server:
        client = UpstreamClient()
        resp = await client.post(server.url, b"{}", {})
        await asyncio.wait_for(junk_sent.wait(), 5)
        await asyncio.sleep(0.1)
        assert await resp.read() == b"abc"  # before: PodIOError("the pod sent bytes after its answer")
        resp.release()
        await asyncio.sleep(0.05)
        assert client._total == 0 and not client._idle.get(resp_key(server))
        await client.close()


def resp_key(server: Server) -> tuple[str, str, int]:
    return ("http", "127.0.0.1", server.port)


async def test_chunked_trailers_are_not_merged_into_the_head():
    ref: list[Server] = []
    reply = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
             b"trailer: x-checksum\r\n\r\n5\r\nhello\r\n0\r\nx-checksum: 42\r\ncontent-type: text/evil\r\n\r\n")
    async with Server(serving(ref, [reply, answer(b"next")])) as server:
        ref.append(server)
        client = UpstreamClient()
        status, raw, data = await fetch(client, server.url)
        assert (status, data) == (200, b"hello")
        names = [k for k, _ in raw]
        assert b"x-checksum" not in names and names.count(b"content-type") == 1  # before: both were in
        assert (await fetch(client, server.url))[2] == b"next"
        assert server.connections == 1  # the trailer ends the answer cleanly: the connection is reused
        await client.close()


async def test_the_router_relays_neither_trailers_nor_a_second_answer():
    metrics = (b'vllm:num_requests_waiting{model_name="m",engine="0"} 0\n'
               b'vllm:num_requests_running{model_name="m",engine="0"} 0\n')
    replies = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        b"8\r\n{\"a\": 1}\r\n0\r\nx-checksum: 42\r\n\r\n",
        answer(b'{"b": 2}') + answer(b'{"smuggled": true}'),
    ]

    async def handler(reader, writer, n):
        while True:
            line, _ = await server.read_request(reader)
            if line.startswith(b"GET /metrics"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(metrics) + metrics)
            elif line.startswith(b"GET "):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            else:
                writer.write(replies.pop(0) if replies else answer(b"{}"))
            await writer.drain()

    async with Server(handler) as server:
        pod = type("P", (), {"name": "raw", "url": f"http://127.0.0.1:{server.port}"})()
        async with running_router(settings_for([pod], retries=0), http=GuardedHttpToolsProtocol) as (base, _):
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                body = {"model": "m", "prompt": "hi", "max_tokens": 1}
                r1 = await c.post("/v1/completions", json=body)
                r2 = await c.post("/v1/completions", json=body)
        assert (r1.status_code, r1.content) == (200, b'{"a": 1}') and "x-checksum" not in r1.headers
        assert (r2.status_code, r2.content) == (200, b'{"b": 2}')  # before: {"b": 2}{"smuggled": true}


# ---- heads that never end, bodies that end at the close -------------------------------------------

@pytest.mark.parametrize("what", ["one endless header", "endless interim answers"])
async def test_a_head_that_never_ends_is_bounded(what):
    async def handler(reader, writer, n):
        await server.read_request(reader)
        if what == "one endless header":
            writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
            piece = b"a" * 16384
        else:
            piece = b"HTTP/1.1 100 Continue\r\nx-note: " + b"a" * 200 + b"\r\n\r\n"
        for _ in range((1 << 20) // len(piece)):  # 1 MiB, at most
            writer.write(piece)
            await writer.drain()
        await asyncio.sleep(10)

    async with Server(handler) as server:
        client = UpstreamClient()
        # before: still waiting (httptools held the unfinished header, growing) after all of it
        with pytest.raises(PodIOError, match="head larger than"):
            await asyncio.wait_for(client.post(server.url, b"{}", {}), 5)
        await client.close()


async def test_a_body_ended_by_the_close_under_a_non_chunked_transfer_coding_is_read_to_the_end():
    async def handler(reader, writer, n):
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity-ish\r\n\r\nuntil the close")
        await writer.drain()

    async with Server(handler) as server:
        client = UpstreamClient()
        assert (await fetch(client, server.url))[2] == b"until the close"  # before: "the pod closed the connection"
        await client.close()


# ---- a reused connection the pod drops ------------------------------------------------------------

async def test_a_reused_connection_dropped_after_the_pod_had_the_request_a_while_is_not_retried():
    async def handler(reader, writer, n):
        await server.read_request(reader)
        writer.write(answer(b"ok"))
        await writer.drain()
        await server.read_request(reader)
        await asyncio.sleep(STALE_CLOSE_S + 0.3)  # the pod works on the request ... and the connection drops
        writer.transport.abort()

    async with Server(handler) as server:
        client = UpstreamClient()
        assert (await fetch(client, server.url, b'{"n": 1}'))[2] == b"ok"
        with pytest.raises(PodIOError, match="closed"):
            await asyncio.wait_for(fetch(client, server.url, b'{"n": 2}'), 10)
        # before: sent again on a new connection, so the pod ran it twice
        assert server.bodies == [b'{"n": 1}', b'{"n": 2}'] and server.connections == 1
        await client.close()


# ---- the pool -------------------------------------------------------------------------------------

def keep_alive(server_ref: list[Server]) -> Handler:
    return serving(server_ref, [answer(b"ok")])


async def test_a_waiter_woken_and_then_cancelled_passes_the_connection_on():
    ref: list[Server] = []
    async with Server(keep_alive(ref)) as server:
        ref.append(server)
        client = UpstreamClient(connect_timeout_s=3.0, max_connections_per_pod=1)
        held = await client.post(server.url, b"{}", {})
        first = asyncio.ensure_future(fetch(client, server.url))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(fetch(client, server.url))
        await asyncio.sleep(0.05)
        assert await held.read() == b"ok"
        held.release()  # wakes the first waiter ...
        first.cancel()  # ... which leaves before it runs
        started = time.monotonic()
        assert (await asyncio.wait_for(second, 5))[2] == b"ok"
        assert time.monotonic() - started < 1.0  # before: ~3 s, when its own deadline woke it
        await asyncio.gather(first, return_exceptions=True)
        await client.close()


async def test_a_connection_put_back_wakes_a_waiter_for_its_own_pod():
    ref1: list[Server] = []
    ref2: list[Server] = []
    async with Server(keep_alive(ref1)) as one, Server(keep_alive(ref2)) as two:
        ref1.append(one)
        ref2.append(two)
        client = UpstreamClient(connect_timeout_s=3.0, max_connections_per_pod=1)
        held1 = await client.post(one.url, b"{}", {})
        held2 = await client.post(two.url, b"{}", {})
        for_two = asyncio.ensure_future(fetch(client, two.url))  # waits first, for pod two
        await asyncio.sleep(0.05)
        for_one = asyncio.ensure_future(fetch(client, one.url))
        await asyncio.sleep(0.05)
        assert await held1.read() == b"ok"
        held1.release()
        started = time.monotonic()
        assert (await asyncio.wait_for(for_one, 5))[2] == b"ok"
        assert time.monotonic() - started < 1.0  # before: the wake-up went to pod two's waiter; ~3 s
        assert await held2.read() == b"ok"
        held2.release()
        assert (await asyncio.wait_for(for_two, 5))[2] == b"ok"
        await client.close()


async def test_under_the_limit_in_all_an_idle_connection_to_another_pod_makes_room():
    ref1: list[Server] = []
    ref2: list[Server] = []
    async with Server(keep_alive(ref1)) as one, Server(keep_alive(ref2)) as two:
        ref1.append(one)
        ref2.append(two)
        client = UpstreamClient(connect_timeout_s=1.0, max_connections=1)
        assert (await fetch(client, one.url))[2] == b"ok"  # its connection is idle now
        assert (await asyncio.wait_for(fetch(client, two.url), 5))[2] == b"ok"  # before: PoolBusy after 1 s
        assert client._total == 1
        held = await client.post(two.url, b"{}", {})  # the one slot is busy, not idle: a new pod waits
        waiting = asyncio.ensure_future(fetch(client, one.url))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await held.read() == b"ok"
        held.release()
        assert (await asyncio.wait_for(waiting, 5))[2] == b"ok"
        assert client._total == 1
        await client.close()


# ---- request headers --------------------------------------------------------------------------------

def test_a_header_the_clients_connection_names_is_not_forwarded():
    raw = [(b"Connection", b"keep-alive, X-Hop"), (b"x-hop", b"secret"), (b"x-ok", b"1"),
           (b"connection", b"x-other"), (b"X-Other", b"2"), (b"x-request-id", b"spoof")]
    # before: x-hop and x-other went to the pod
    assert upstream_headers(raw, "rid", drop_credentials=False) == {
        "x-ok": "1", "x-request-id": "rid", "content-type": "application/json"}
    assert upstream_headers([(b"connection", b"keep-alive"), (b"x-ok", b"1")], "rid", False)["x-ok"] == "1"
