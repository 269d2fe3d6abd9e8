"""The router's upstream HTTP/1.1 client (router/upstream.py) against raw asyncio servers on loopback.

Each server is a few lines of asyncio that answers exactly the bytes a test needs (a keep-alive
answer, a chunked stream, a malformed status line, a connection closed as a request arrives), so
each bound and failure of the client is seen on a real socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from router.dispatch import upstream_headers
from router.upstream import PodIOError, PoolBusy, UpstreamClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """A loopback server calling ``handler(reader, writer, connection number)`` per connection."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.connections = 0
        self.closed_by_client = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> Server:
        async def on_connect(reader, writer):
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nX-Pod-Note: a\r\nx-pod-note: b\r\n" + extra + \
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def keep_alive(server_ref: list[Server]) -> Handler:
    async def handler(reader, writer, n):
        while True:
            body = await server_ref[0].read_request(reader)
            writer.write(answer(b"echo:" + body))
            await writer.drain()
    return handler


async def post(client: UpstreamClient, url: str, body: bytes = b"{}", headers: dict | None = None) -> tuple:
    resp = await client.post(url, body, headers or {"content-type": "application/json"})
    data = await resp.read()
    resp.release()
    return resp.status, resp.headers, data


async def test_answers_come_back_whole_over_one_kept_alive_connection():
    ref: list[Server] = []
    async with Server(keep_alive(ref)) as server:
        ref.append(server)
        client = UpstreamClient()
        for i in range(3):
            status, headers, data = await post(client, server.url, b'{"n": %d}' % i, {"x-request-id": "r1"})
            assert (status, data) == (200, b'echo:{"n": %d}' % i)
        assert server.connections == 1
        assert headers["X-POD-NOTE"] == "a, b" and headers.get("content-type") == "application/json"
        head = server.requests[0].split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"post /v1/completions http/1.1\r\n")
        assert b"\r\nhost: 127.0.0.1:" in head and b"\r\ncontent-length: 8" in head and b"x-request-id: r1" in head
        await client.close()


async def test_a_chunked_stream_arrives_chunk_by_chunk_and_then_ends():
    gate = asyncio.Event()

    async def handler(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"7\r\ndata: 1\r\n")
        await gate.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with Server(handler) as server:
        client = UpstreamClient()
        resp = await client.post(server.url, b"", {})
        assert await resp.readany() == b"data: 1"
        gate.set()
        assert await resp.readany() == b"data: 2"
        assert await resp.readany() == b""
        await client.close()


async def test_an_answer_ended_by_closing_is_read_to_the_end_and_its_connection_not_reused():
    async def handler(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"until\": \"close\"}")
        await writer.drain()

    async with Server(handler) as server:
        client = UpstreamClient()
        assert (await post(client, server.url))[2] == b'{"until": "close"}'
        assert (await post(client, server.url))[2] == b'{"until": "close"}'
        assert server.connections == 2
        await client.close()


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 OK\r\n\r\n",  # no status code
    b"NOT HTTP AT ALL\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 70_000 + b"\r\ncontent-length: 0\r\n\r\n",  # headers over 64 KiB
    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",  # closed before the declared length
])
async def test_a_malformed_or_cut_answer_is_a_pod_error(reply):
    async def handler(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()

    async with Server(handler) as server:
        client = UpstreamClient()
        with pytest.raises(PodIOError):
            await post(client, server.url)
        await client.close()


@pytest.mark.parametrize("reply", [
    # httptools takes any three digits; no client can be given 600 or 999 (uvicorn's send raised)
    b"HTTP/1.1 600 X\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 999 X\r\ncontent-length: 0\r\n\r\n",
    # a switch of protocols nobody asked for: httptools raises HttpParserUpgrade, no HttpParserError
    # subclass, which escaped to the event loop as a fatal transport error
    b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
])
async def test_a_status_no_client_can_be_given_is_a_malformed_answer(reply):
    async def handler(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        await asyncio.sleep(1)

    async with Server(handler) as server:
        client = UpstreamClient()
        with pytest.raises(PodIOError, match="malformed answer"):
            await post(client, server.url)
        await client.close()


async def test_silence_past_the_read_timeout_and_a_refused_connect_are_pod_errors():
    async def handler(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(10)

    async with Server(handler) as server:
        client = UpstreamClient(read_timeout_s=0.2)
        with pytest.raises(PodIOError, match="read timeout"):
            await asyncio.wait_for(post(client, server.url), 5)
        url = server.url
    with pytest.raises(PodIOError, match="connect"):
        await asyncio.wait_for(post(UpstreamClient(connect_timeout_s=1.0), url), 5)


async def test_cancelling_a_request_closes_its_connection_so_the_pod_sees_the_client_go():
    seen_eof = asyncio.Event()

    async def handler(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(100)  # the body; then nothing until the client closes
        if await reader.read(100) == b"":
            seen_eof.set()

    async with Server(handler) as server:
        client = UpstreamClient()
        task = asyncio.ensure_future(client.post(server.url, b"{}", {}))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.wait_for(seen_eof.wait(), 5)
        assert client._total == 0
        await client.close()


async def test_a_kept_alive_connection_the_pod_closes_as_the_request_arrives_is_retried_once_on_a_new_one():
    async def handler(reader, writer, n):
        first = True
        while True:
            await reader.readuntil(b"\r\n\r\n")
            await reader.read(2)
            if not first:
                writer.transport.abort()  # the pod closes the reused connection without answering
                return
            first = False
            writer.write(answer(b"ok"))
            await writer.drain()

    async with Server(handler) as server:
        client = UpstreamClient()
        assert (await post(client, server.url))[2] == b"ok"
        assert (await post(client, server.url))[2] == b"ok"  # the reuse failed; a new connection answered
        assert server.connections == 2

    async def never_answers(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        writer.transport.abort()

    async with Server(never_answers) as server:  # a fresh connection that fails is not retried
        with pytest.raises(PodIOError):
            await post(UpstreamClient(), server.url)
        assert server.connections == 1


async def test_the_pool_limit_makes_a_request_wait_for_a_slot_and_gives_up_at_the_connect_timeout():
    ref: list[Server] = []
    async with Server(keep_alive(ref)) as server:
        ref.append(server)
        client = UpstreamClient(connect_timeout_s=0.3, max_connections_per_pod=1)
        held = await client.post(server.url, b"{}", {})
        with pytest.raises(PoolBusy):
            await client.post(server.url, b"{}", {})
        waiting = asyncio.ensure_future(post(client, server.url, b"{}"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await held.read() == b"echo:{}"
        held.release()
        assert (await asyncio.wait_for(waiting, 5))[2] == b"echo:{}"
        assert server.connections == 1
        await client.close()


async def test_answers_and_streams_are_bounded_in_memory():
    big = b"x" * (3 * 1024 * 1024)

    async def handler(reader, writer, n):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(big)).encode() + b"\r\n\r\n")
        writer.write(big)
        await writer.drain()
        await asyncio.sleep(5)

    async with Server(handler) as server:
        client = UpstreamClient(max_response_bytes=1024 * 1024)
        with pytest.raises(PodIOError, match="larger than"):
            await post(client, server.url)
        streaming = UpstreamClient(max_buffer_bytes=256 * 1024)
        resp = await streaming.post(server.url, b"", {})
        await asyncio.sleep(0.5)  # the client reads nothing meanwhile
        assert resp._conn is not None and resp._conn.buffered < 256 * 1024 + 512 * 1024
        got = 0
        while chunk := await resp.readany():
            got += len(chunk)
        assert got == len(big)  # reading resumes once drained
        resp.release()
        await client.close()
        await streaming.close()


async def test_an_idle_connection_older_than_idle_s_is_not_reused():
    ref: list[Server] = []
    async with Server(keep_alive(ref)) as server:
        ref.append(server)
        client = UpstreamClient(idle_s=0.05)
        await post(client, server.url)
        await asyncio.sleep(0.15)
        await post(client, server.url)
        assert server.connections == 2
        await client.close()


def test_a_client_header_that_would_split_the_upstream_request_is_dropped():
    raw = [(b"x-ok", b"fine"), (b"x-bad", b"a\r\nx-injected: 1"), (b"x-nul", b"a\x00b"), (b"content-type", b"json"),
           (b"x-cr", b"a\rb"), (b"x-lf", b"a\nb"), (b"x-name\r\nx-injected", b"1")]
    assert upstream_headers(raw, "rid", drop_credentials=True) == {
        "x-ok": "fine", "content-type": "application/json", "x-request-id": "rid"}
