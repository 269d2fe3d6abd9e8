"""Gateway overhead: latency kvroute adds over calling a pod directly, and throughput through it.

Everything runs on this machine over loopback: a fast static backend (raw asyncio + httptools,
answering every completion with the same small JSON), and in front of it, one at a time, kvroute
(``kvroute serve``, one process and two workers), vllm-router (``cache_aware``) when it is
installed, three bare FastAPI proxies, on aiohttp, on httpx and on kvroute's own upstream
client (``router/upstream.py``), to re-measure the client choice, kvroute's server stack without
its routing (uvicorn calling a plain ASGI function, as kvroute's ``/v1/*`` fast path is called),
and the floor of any Python proxy here: a raw asyncio + httptools server on uvloop forwarding with
kvroute's client, no framework and no routing, in one and two processes. The load generator is also raw asyncio +
httptools with pre-built requests, so it costs little CPU.

    python bench/overhead.py [--seconds 5] [--connections 32] [--peers-venv /tmp/peers-venv]
    python bench/overhead.py --sizes 20,1000,8000,32000 [--kinds chat,completion] --json results/overhead_sizes.json

Prints one row per target: 1-connection p50/p99 latency and added p50 over direct, and 32-connection
throughput and p99. The last line is the headline.

With ``--sizes`` the requests are of about that many prompt tokens (a real BPE tokenizer,
``--tokenizer``: by default the real-vLLM tier's model if it is built), as multi-turn traffic sends
them: each request 90 % a follow-up (the conversation so far plus ~300 new tokens) and 10 % new,
as chat requests and as completions of the same text; kvroute is given the same tokenizer. Each row
has thousands of distinct requests (``distinct_count``), sent in their order by all connections
together, so kvroute sends none twice in a row. A follow-up stands at least twice ``--connections``
places after its conversation's previous turn (with up to that many + 36 conversations open), so the
turn it follows has been answered before it is sent, as a user's next turn comes after the answer it
quotes; until 2026-12-05 40 conversations were open and 70 % of the 8k follow-ups stood within 32
places of the turn before them, so went out while it was still in flight, which no client does (a
second worker then met a conversation whose last turn the other worker had not yet tokenized:
``follow_up_gap``). A faster peer may wrap around (each row's JSON has ``sent`` and ``distinct``).
vllm-router and sglang-router (``cache_aware``) run in the same pass. A last
measurement runs one connection of cold prompts of the largest size beside one connection of
small requests, in ``--mixed-windows`` windows of ``--seconds`` one after the other, and reports the
small requests' p99 over all windows together and each window's (``cold_count`` distinct prompts:
none is sent twice, else a second send would be answered from the prefix token cache). The peers are
looked for in --peers-venv (``python -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install vllm-router==0.1.17
sglang-router==0.3.2``); they are never project dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from fastapi import Request

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import check_peer, stamp  # noqa: E402
from simulator.testing import cpu_seconds, free_port, process_tree, spawn, stop_process, wait_ready  # noqa: E402

PROBE = {"model": "sim-model", "prompt": "Hello, my name is", "max_tokens": 8}
BODY = json.dumps(PROBE).encode()
ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "sim-model",
                     "choices": [{"index": 0, "text": " Alice and I like", "finish_reason": "length",
                                  "logprobs": None}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "sim-model", "object": "model", "owned_by": "bench"}]}).encode()
METRICS = (b'vllm:num_requests_waiting{model_name="sim-model",engine="0"} 0\n'
           b'vllm:num_requests_running{model_name="sim-model",engine="0"} 0\n'
           b'vllm:kv_cache_usage_perc{model_name="sim-model",engine="0"} 0\n'
           b'vllm:cache_config_info{block_size="16",engine="0"} 1\n')


# ---------------------------------------------------------------------------------------------
# the static backend
# ---------------------------------------------------------------------------------------------

def _response(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: " +
            str(len(body)).encode() + b"\r\n\r\n" + body)


# a streamed answer as vLLM sends one: Server-Sent Events in HTTP chunks, one token's event per chunk
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"


def _sse_chunk(data: bytes) -> bytes:
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n" % len(event) + event + b"\r\n"


STREAM_EVENT = _sse_chunk(json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "sim-model",
                                      "choices": [{"index": 0, "text": " word", "logprobs": None,
                                                   "finish_reason": None, "stop_reason": None}]}).encode())
STREAM_END = _sse_chunk(b"[DONE]") + b"0\r\n\r\n"


class _Backend(asyncio.Protocol):
    R_COMPLETION = _response(b"200 OK", ANSWER)
    R_MODELS = _response(b"200 OK", MODELS)
    R_METRICS = _response(b"200 OK", METRICS, b"text/plain")
    R_EMPTY = _response(b"200 OK", b"{}")
    stream_gap_s = 0.001  # between a streamed answer's events (``--stream-gap-ms``)

    def connection_made(self, transport):
        import httptools

        self.t = transport
        self.url = b""
        self.body = b""
        self.parser = httptools.HttpRequestParser(self)

    def on_url(self, url):
        self.url = url

    def on_message_begin(self):
        self.body = b""

    def on_body(self, body):
        self.body += body

    def _stream(self, left: int) -> None:
        """One event, then the next after ``stream_gap_s``: each arrives in its own read, as a
        pod's tokens do, one engine step apart."""
        if self.t.is_closing():
            return
        if left <= 0:
            self.t.write(STREAM_END)
            return
        self.t.write(STREAM_EVENT)
        asyncio.get_running_loop().call_later(self.stream_gap_s, self._stream, left - 1)

    def on_message_complete(self):
        u = self.url
        if u.startswith(b"/v1/completions") or u.startswith(b"/v1/chat/completions") or u.startswith(b"/generate"):
            if b'"stream": true' in self.body or b'"stream":true' in self.body:
                events = json.loads(self.body).get("max_tokens") or 16
                self.t.write(STREAM_HEAD)
                self._stream(events)
            else:
                self.t.write(self.R_COMPLETION)
        elif u.startswith(b"/v1/models"):
            self.t.write(self.R_MODELS)
        elif u.startswith(b"/metrics"):
            self.t.write(self.R_METRICS)
        else:
            self.t.write(self.R_EMPTY)

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except Exception:
            self.t.close()


def run_backend(port: int, stream_gap_s: float = 0.001) -> None:
    import uvloop

    _Backend.stream_gap_s = stream_gap_s

    async def main():
        server = await asyncio.get_running_loop().create_server(_Backend, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# ---------------------------------------------------------------------------------------------
# bare proxies (to compare client pools)
# ---------------------------------------------------------------------------------------------

def run_bare_proxy(port: int, upstream: str, client: str) -> None:
    from contextlib import asynccontextmanager

    import uvicorn
    from fastapi import FastAPI
    from starlette.responses import Response

    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        if client == "aiohttp":
            import aiohttp
            state["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        elif client == "kvroute":
            from router.upstream import UpstreamClient
            state["s"] = UpstreamClient()
        else:
            import httpx
            state["s"] = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                             max_keepalive_connections=None))
        yield
        await (state["s"].aclose() if client == "httpx" else state["s"].close())

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def proxy(request: Request):
        body = await request.body()
        if client == "kvroute":
            resp = await state["s"].post(upstream + "/v1/completions", body, {"content-type": "application/json"})
            data = await resp.read()
            resp.release()
            return Response(data, status_code=resp.status, media_type="application/json")
        if client == "aiohttp":
            async with state["s"].post(upstream + "/v1/completions", data=body,
                                       headers={"content-type": "application/json"}) as r:
                data = await r.read()
                return Response(data, status_code=r.status, media_type="application/json")
        r = await state["s"].post(upstream + "/v1/completions", content=body,
                                  headers={"content-type": "application/json"})
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="error",
                access_log=False)


class _RawProxy(asyncio.Protocol):
    """The least a Python proxy can do per request: httptools' parser in, kvroute's upstream client
    out, the answer written back; no framework, no parsing of the body, no routing."""

    def __init__(self, client, upstream: str):
        import httptools

        self.client, self.url = client, upstream + "/v1/completions"
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []

    def connection_made(self, transport):
        self.t = transport

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self._forward(body))

    async def _forward(self, body: bytes):
        resp = await self.client.post(self.url, body, {"content-type": "application/json"})
        data = await resp.read()
        resp.release()
        self.t.write(_response(b"200 OK", data))

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except Exception:
            self.t.close()


def run_asgi_proxy(port: int, upstream: str) -> None:
    """kvroute's server stack without its routing: uvicorn (httptools, uvloop) calling a plain ASGI
    function that reads the body, forwards it with kvroute's client and answers with a Starlette
    ``Response``, as kvroute's fast path for ``/v1/*`` does (``router/api.py`` KVRouteApp)."""
    import uvicorn
    from starlette.responses import Response

    from router.upstream import UpstreamClient

    clients: list = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                clients.append(UpstreamClient())
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        resp = await clients[0].post(upstream + "/v1/completions", body, {"content-type": "application/json"})
        data = await resp.read()
        resp.release()
        await Response(data, status_code=resp.status, media_type="application/json")(scope, receive, send)

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="error",
                access_log=False)


def run_raw_proxy(port: int, upstream: str) -> None:
    """One process of the raw proxy floor; several bind the same port (SO_REUSEPORT), as workers do."""
    import uvloop

    from router.upstream import UpstreamClient

    async def main():
        client = UpstreamClient()
        server = await asyncio.get_running_loop().create_server(lambda: _RawProxy(client, upstream), "127.0.0.1",
                                                                port, backlog=1024, reuse_port=True)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# ---------------------------------------------------------------------------------------------
# the load generator
# ---------------------------------------------------------------------------------------------

class _Conn(asyncio.Protocol):
    """One keep-alive connection sending requests one at a time: each the next of ``requests`` by the
    shared ``cursor``, so all connections together send them in their order, wrapping at the end."""

    def __init__(self, requests: list[bytes], latencies: list[float], stop_at: float, done: asyncio.Future,
                 errors: list, cursor: Iterator[int], firsts: list[float] | None = None):
        import httptools

        self.requests, self.lat, self.stop_at, self.done, self.errors = requests, latencies, stop_at, done, errors
        self.cursor = cursor
        self.parser = httptools.HttpResponseParser(self)
        self.sent = 0.0
        self.in_flight = False
        self.first: float | None = None
        self.firsts = firsts if firsts is not None else []  # time to each answer's first body byte

    def connection_made(self, transport):
        self.t = transport
        self._send()

    def _send(self):
        self.sent = time.perf_counter()
        self.in_flight = True
        self.first = None
        self.t.write(self.requests[next(self.cursor) % len(self.requests)])

    def on_body(self, body):
        if self.first is None:
            self.first = time.perf_counter()

    def on_message_complete(self):
        now = time.perf_counter()
        self.in_flight = False
        if self.parser.get_status_code() != 200:  # a miss: at infinity in the percentiles
            self.errors.append(self.parser.get_status_code())
            self.lat.append(float("inf"))
            self.firsts.append(float("inf"))
        else:
            self.lat.append(now - self.sent)
            self.firsts.append((self.first or now) - self.sent)
        if now < self.stop_at:
            self._send()
        elif not self.done.done():
            self.done.set_result(None)

    def data_received(self, data):
        self.parser.feed_data(data)

    def connection_lost(self, exc):
        if self.in_flight:  # sent and never answered: a miss, not a request left out
            self.in_flight = False
            self.errors.append("connection lost")
            self.lat.append(float("inf"))
            self.firsts.append(float("inf"))
        if not self.done.done():
            self.done.set_result(None)


def http_request(path: str, body: bytes) -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def load(port: int, connections: int, seconds: float, warmup: float = 0.5,
               requests: list[bytes] | None = None, cursor: Iterator[int] | None = None,
               pids: list[int] | None = None) -> dict:
    """``connections`` connections for ``seconds`` after ``warmup``; requests are taken in order from
    ``cursor`` (pass one cursor to several calls to go on where the last stopped). With ``pids`` (the
    target's processes), also the CPU time they spent per request answered (``cpu_us_per_request``:
    user + system, every thread and child process, over the timed part only)."""
    requests = requests or [http_request("/v1/completions", BODY)]
    cursor = cursor if cursor is not None else itertools.count()
    loop = asyncio.get_running_loop()
    # warm-up (connection pools, JIT-free but caches)
    w_lat: list[float] = []
    dones = []
    for _ in range(connections):
        fut = loop.create_future()
        await loop.create_connection(lambda fut=fut: _Conn(requests, w_lat, time.perf_counter() + warmup, fut, [],
                                                           cursor), "127.0.0.1", port)
        dones.append(fut)
    await asyncio.gather(*dones)
    lat: list[float] = []
    firsts: list[float] = []
    errors: list = []
    dones, transports = [], []
    tree = process_tree(pids) if pids else []
    cpu0 = cpu_seconds(tree)
    started = time.perf_counter()
    stop_at = started + seconds
    for _ in range(connections):
        fut = loop.create_future()
        t, _p = await loop.create_connection(lambda fut=fut: _Conn(requests, lat, stop_at, fut, errors, cursor, firsts),
                                             "127.0.0.1", port)
        dones.append(fut)
        transports.append(t)
    await asyncio.gather(*dones)
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds(tree) - cpu0
    for t in transports:
        t.close()
    lat.sort()
    firsts.sort()
    ok = len(lat) - len(errors)  # answered 200; an error or a lost request is at infinity in ``lat``

    def q(p, xs=lat):
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")

    return {"requests": len(lat), "latencies": lat, "errors": len(errors), "rps": ok / elapsed,
            "p50_ms": q(0.5), "p99_ms": q(0.99),
            "first_byte_p50_ms": q(0.5, firsts), "first_byte_p99_ms": q(0.99, firsts),
            "mean_ms": statistics.fmean(lat) * 1000 if lat else float("nan"),
            "cpu_us_per_request": cpu / ok * 1e6 if tree and ok else None}


# ---------------------------------------------------------------------------------------------
# real prompt sizes: multi-turn chat requests
# ---------------------------------------------------------------------------------------------

WORDS = ("the of and to in is that for it as with was on be by this are at from or have an they which one you "
         "had not but what all were when we there can more time about would make like just know take people "
         "into year your good some could them see other than then now look only come its over think also back "
         "after use two how our work first well way even new want because any these give day most us").split()


def _words(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tier_model() -> Path | None:
    """The real-vLLM tier's tiny model folder (its tokenizer.json), or None after saying how to get it."""
    from realvllm.engines import RealVLLMUnavailable, find

    try:
        return find().model
    except RealVLLMUnavailable as exc:
        print(f"{exc}: build the real-vLLM tier (make real-vllm) for its tokenizer")
        return None


def chat_requests(tokenizer, size: int, count: int = 200, conversations: int = 40, seed: int = 0,
                  follow_up: float = 0.9, turn_words: int = 280, kind: str = "chat",
                  sample: int = 0, turns: int = 10, gap: int = 0) -> tuple[list[bytes], float]:
    """``count`` requests of about ``size`` prompt tokens, as multi-turn traffic sends them: each a
    follow-up (with probability ``follow_up``) of one of at most ``conversations`` open conversations,
    that is all of it so far plus an answer and a new turn (~300 words), or else a new conversation.
    With ``gap``, a follow-up continues only a conversation whose latest request is at least ``gap``
    places back (a new conversation opens when none is, or the longest idle continues when the
    ``conversations`` are all open): ``follow_up_gap``.
    A conversation closes after ``turns`` follow-ups, so its prompts grow by whole turns and every
    follow-up's prefix is exactly an earlier request's. ``kind`` "chat" sends the messages,
    "completion" the same conversation as one prompt string ("role: content" lines). Returns the
    HTTP requests and their mean prompt tokens as the router counts them (over ``sample`` of them,
    spread evenly; 0 = all)."""
    import random

    from indexer.tokens import chat_request_ids

    rng = random.Random(seed * 1000 + size)
    if size <= 300:  # small prompts: all different, no history
        histories = [[{"role": "user", "content": _words(rng, max(size - 8, 1))}] for _ in range(count)]
    else:
        # fewer turns where ``turns`` of them would outgrow the size (under ~3k tokens: 75 % follow-ups
        # at 1k), and the system prompt so that a conversation's prompts centre on about the size
        turns = max(2, min(turns, int((size * 0.9 - 50 - turn_words) * 2 / (turn_words + 40))))
        system_words = max(int(size * 0.9) - turn_words - (turns // 2) * (turn_words + 40), 50)
        convs: list[list[dict]] = []
        histories = []
        last: dict[int, int] = {}  # id(conversation) -> position of its latest request
        for i in range(count):
            history = None
            if convs and not (rng.random() > follow_up and len(convs) < conversations):
                ready = [c for c in convs if i - last[id(c)] >= gap] if gap else convs
                if ready:
                    history = rng.choice(ready)
                elif len(convs) >= conversations:
                    history = min(convs, key=lambda c: last[id(c)])
            if history is None:
                convs.append([{"role": "system", "content": _words(rng, system_words)}])
                history = convs[-1]
            else:
                history.append({"role": "assistant", "content": _words(rng, 40)})
            last[id(history)] = i
            history.append({"role": "user", "content": _words(rng, turn_words)})
            histories.append([dict(m) for m in history])
            if len(history) >= 2 * turns + 2:  # system + the first turn + ``turns`` follow-ups
                convs.remove(history)
    if kind == "chat":
        bodies = [{"model": "sim-model", "messages": h, "max_tokens": 8} for h in histories]
        path = "/v1/chat/completions"
    else:
        bodies = [{"model": "sim-model", "prompt": "\n".join(f"{m['role']}: {m['content']}" for m in h),
                   "max_tokens": 8} for h in histories]
        path = "/v1/completions"
    step = max(1, len(bodies) // sample) if sample else 1
    counted = [len(chat_request_ids(b, tokenizer)) if kind == "chat" else len(tokenizer.encode(b["prompt"]))
               for b in bodies[::step]]
    return [http_request(path, json.dumps(b).encode()) for b in bodies], sum(counted) / len(counted)


def follow_up_gap(connections: int) -> int:
    """How many places a follow-up stands after its conversation's previous turn in a sized row's list:
    twice the connections. The connections take the list in order, one request each at a time, so
    the turn before is still in flight only if it took longer than the ~``2 * connections`` requests
    sent after it, twice the mean time a request is in flight. With 40 conversations and no gap (the
    list before 2026-12-05), a follow-up of the 8k row came a median 16 places after its previous
    turn, 70 % of them within 32: sent beside it, before its answer, which no chat client does (with
    the gap: a median 83, none within 64). Two
    workers then tokenized ~37 % of the 8k-token requests in their tokenize processes, every
    follow-up whose last turn the other worker had not yet tokenized among them, where ~10 % (the new
    conversations) went there with the gap (a throwaway harness at 32 connections: 917 against
    1,120 req/s, 2,001 against 1,623 µs of CPU per request; one process within noise, 1,369 and 1,252
    req/s)."""
    return 2 * connections


def distinct_count(size: int, budget_bytes: int = 600_000_000) -> int:
    """How many requests of ``size`` tokens a sized row gets: more than kvroute sends in one row at
    the rates this machine gives, within ``budget_bytes`` of request bodies (about 5.5 bytes a token;
    200 MB until kvroute tokenized with tiktoken's twin and went round 4,545 8k-token requests; at
    most 12,000 until one kvroute process sent 14,632 small chat requests in a row)."""
    return max(200, min(24000, budget_bytes // max(1, int(size * 5.5))))


async def mixed(port: int, seconds: float, big: list[bytes], small: list[bytes], latencies: bool = False,
                cursor: Iterator[int] | None = None) -> dict:
    """One connection of big cold prompts beside one of small requests: the small ones' latency (with
    ``latencies``, each small request's too, in seconds, under ``small_latencies``). Pass ``cursor``
    to go on through ``big`` where an earlier call stopped (``big_sent`` then counts from its start)."""
    cursor = cursor if cursor is not None else itertools.count()
    got = await asyncio.gather(load(port, 1, seconds, requests=big, cursor=cursor),
                               load(port, 1, seconds, requests=small))
    return {"small_p50_ms": got[1]["p50_ms"], "small_p99_ms": got[1]["p99_ms"], "big_p50_ms": got[0]["p50_ms"],
            "big_sent": next(cursor), "big_distinct": len(big),
            **({"small_latencies": got[1]["latencies"]} if latencies else {})}


def mixed_windows(port: int, seconds: float, windows: int, big: list[bytes], small: list[bytes]) -> dict:
    """``mixed`` ``windows`` times on one router, going on through ``big``: the small requests' p50
    and p99 over all windows together (a 3-second window's p99 is its ~35th slowest small request,
    and moved by 2-4 ms from one run to the next), and each window's p99."""
    cursor = itertools.count()
    runs = [asyncio.run(mixed(port, seconds, big, small, latencies=True, cursor=cursor)) for _ in range(windows)]
    lat = sorted(x for r in runs for x in r.pop("small_latencies"))

    def q(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {"small_p50_ms": q(0.5), "small_p99_ms": q(0.99), "small_requests": len(lat),
            "window_p99_ms": [r["small_p99_ms"] for r in runs],
            "big_p50_ms": statistics.median(r["big_p50_ms"] for r in runs),
            "big_sent": runs[-1]["big_sent"] - (windows - 1), "big_distinct": len(big), "windows": windows}


def cold_count(size: int, seconds: float) -> int:
    """How many distinct cold prompts of ``size`` tokens the big connection beside the small one gets:
    more than it can send (a cold prompt costs at least ~0.3 us a token to tokenize with tiktoken's
    twin of the tokenizer, ~0.7 us with the tokenizers library), so none is sent twice and answered
    from the prefix token cache; at most ``distinct_count(size)``."""
    return min(distinct_count(size), max(60, int((seconds + 1.0) * 4e6 / size)))


# ---------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------

def start_backend(procs: list[subprocess.Popen], stream_gap_ms: float = 1.0) -> tuple[int, str]:
    """The static backend in a child process (added to ``procs``); returns its port and URL."""
    port = free_port()
    backend = spawn([sys.executable, __file__, "--role", "backend", "--port", str(port),
                     "--stream-gap-ms", str(stream_gap_ms)])
    procs.append(backend)
    upstream = f"http://127.0.0.1:{port}"
    wait_ready(f"{upstream}/health", backend)
    return port, upstream


def warn_if_repeated(name: str, sent: int, distinct: int) -> bool:
    """Print a warning when ``sent`` requests went round a list of ``distinct`` ones: the repeats find
    kvroute's caches (prefix tokens, the index's credits) warm, which flatters it. True if so."""
    if sent <= distinct:
        return False
    print(f"  WARNING: {name} went round its {distinct} distinct requests (repeats from the second round)", flush=True)
    return True


def measure(name: str, port: int, args, requests: list[bytes] | None = None,
            procs: list[subprocess.Popen] | None = None) -> dict:
    """1 connection, then ``args.connections``, going on through ``requests`` in order; with ``procs``
    (the target's processes) also their CPU per request at ``args.connections``."""
    cursor = itertools.count()
    one = asyncio.run(load(port, 1, args.seconds, requests=requests, cursor=cursor))
    many = asyncio.run(load(port, args.connections, args.seconds, requests=requests, cursor=cursor,
                            pids=[p.pid for p in procs] if procs else None))
    cpu = many["cpu_us_per_request"]
    row = {"target": name, "c1_p50_ms": one["p50_ms"], "c1_p99_ms": one["p99_ms"], "c1_rps": one["rps"],
           "c1_first_byte_p50_ms": one["first_byte_p50_ms"],
           f"c{args.connections}_rps": many["rps"], f"c{args.connections}_p99_ms": many["p99_ms"],
           f"c{args.connections}_cpu_us_per_request": cpu,
           "errors": one["errors"] + many["errors"], "sent": next(cursor), "distinct": len(requests or [0])}
    cpu_text = f" {cpu:.0f} us CPU/request" if cpu is not None else ""
    if name.startswith("kvroute") and requests is not None:
        warn_if_repeated(name, row["sent"], len(requests))
    print(f"  {name:<28} 1 conn: p50 {one['p50_ms']:.3f} ms p99 {one['p99_ms']:.3f} ms ({one['rps']:.0f} req/s)   "
          f"{args.connections} conn: {many['rps']:.0f} req/s p99 {many['p99_ms']:.2f} ms{cpu_text}   "
          f"errors {row['errors']}", flush=True)
    return row


def peer_commands(venv: Path, upstream: str) -> list[tuple[str, str, list[str]]]:
    """(distribution, row name, command less its ``--port``) of each peer router, ``cache_aware``
    in front of ``upstream``."""
    return [
        ("vllm-router", "vllm-router (cache_aware)",
         [str(venv / "bin" / "vllm-router"), "--worker-urls", upstream, "--policy", "cache_aware",
          "--log-level", "error", "--disable-retries", "--disable-circuit-breaker"]),
        ("sglang-router", "sglang-router (cache_aware)",
         [str(venv / "bin" / "sglang-router"), "launch", "--host", "127.0.0.1", "--worker-urls", upstream,
          "--policy", "cache_aware", "--log-level", "warn", "--prometheus-host", "127.0.0.1",
          "--prometheus-port", str(free_port())]),
    ]


def peer_version(venv: Path, dist: str) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def sized(args) -> int:
    """``--sizes``: every target at every prompt size and kind, then the big-beside-small measurement."""
    from indexer.tokens import HFTokenizer
    from realvllm.engines import RealVLLMUnavailable, find

    try:
        folder = Path(args.tokenizer) if args.tokenizer else find().model  # the real tier's tiny model
    except RealVLLMUnavailable as exc:
        print(f"{exc}, or pass --tokenizer")
        return 2
    if not (folder / "tokenizer.json").is_file():
        print(f"no tokenizer.json in {folder}: build the real-vLLM tier (make real-vllm) or pass --tokenizer")
        return 2
    tok = HFTokenizer(folder)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    kinds = [k for k in args.kinds.split(",") if k.strip()]
    asyncio.set_event_loop_policy(__import__("uvloop").EventLoopPolicy())
    gap = follow_up_gap(args.connections) if args.follow_up_gap < 0 else args.follow_up_gap
    workload = {(kind, size): chat_requests(tok, size, count=distinct_count(size), kind=kind, sample=100,
                                            gap=gap, conversations=gap + 36 if gap else 40)
                for kind in kinds for size in sizes}
    procs: list[subprocess.Popen] = []
    out: dict = {**stamp("overhead.py", args.argv), "tokenizer": str(folder), "seconds": args.seconds,
                 "connections": args.connections,
                 "follow_up_gap": gap, "kinds": kinds, "rows": [], "mixed": {}}
    venv = Path(args.peers_venv)
    try:
        bport, upstream = start_backend(procs)
        print(f"overhead bench at real sizes: {args.seconds:.0f} s per measurement, {os.cpu_count()} CPUs, "
              f"tokenizer {folder}")
        targets: list[tuple[str, list[str] | None]] = [("direct", None)]
        pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
        for workers in (1, 2):
            targets.append((f"kvroute ({workers} worker{'s' if workers > 1 else ''})",
                            [sys.executable, "-m", "router.cli", "serve", "--pods", pods, "--log-level", "error",
                             "--workers", str(workers), "--tokenizer", str(folder)]))
        for dist, name, cmd in peer_commands(venv, upstream):
            if dist in args.skip:
                continue
            if not Path(cmd[0]).exists():
                print(f"  {dist}: not installed in {venv} (see the docstring); row skipped")
                continue
            out[f"{dist}_version"] = peer_version(venv, dist)
            print(f"{dist} {out[f'{dist}_version']} from {venv}")
            check_peer(dist, out[f"{dist}_version"])
            targets.append((name, cmd))
        for name, cmd in targets:
            port = bport
            proc = None
            if cmd is not None:
                port = free_port()
                proc = spawn(cmd + ["--port", str(port)])
                procs.append(proc)
                if name.startswith("kvroute"):
                    wait_ready(f"http://127.0.0.1:{port}/ready", proc, 60.0)
                    time.sleep(2.0)
                else:
                    wait_ready(f"http://127.0.0.1:{port}/v1/completions", proc, 60.0, body=PROBE)
            for kind in kinds:
                for size in sizes:
                    requests, mean = workload[(kind, size)]
                    row = measure(f"{name} @ {kind} {mean:.0f} tokens", port, args, requests,
                                  procs=[proc] if proc is not None else procs[:1])
                    out["rows"].append({**row, "target": name, "kind": kind, "size": size,
                                        "mean_prompt_tokens": mean})
            if size_big := max(sizes):
                n_big = cold_count(size_big, args.seconds * args.mixed_windows)
                big, _ = chat_requests(tok, size_big, count=n_big, follow_up=0.0, conversations=n_big, seed=7,
                                       sample=10)
                small, _ = chat_requests(tok, 20, count=50, seed=8)
                m = mixed_windows(port, args.seconds, args.mixed_windows, big, small)
                out["mixed"][name] = m
                windows = ", ".join(f"{x:.2f}" for x in m["window_p99_ms"])
                print(f"  {name:<28} small requests beside cold {size_big}-token ones: p50 {m['small_p50_ms']:.2f} ms "
                      f"p99 {m['small_p99_ms']:.2f} ms over {m['small_requests']} (windows {windows} ms; "
                      f"{m['big_sent']} of {n_big} cold prompts sent)", flush=True)
                if name.startswith("kvroute") and m["big_sent"] > n_big:
                    print(f"  WARNING: {name} was sent some cold prompts twice (cached the second time)", flush=True)
            if proc is not None:
                stop_process(proc)
    finally:
        for p in procs:
            stop_process(p)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    key = f"c{args.connections}_rps"
    lines = []
    for kind in kinds:
        for size in sizes:
            rows = {r["target"]: r for r in out["rows"] if r["kind"] == kind and r["size"] == size}
            d, k1, k2 = rows.get("direct"), rows.get("kvroute (1 worker)"), rows.get("kvroute (2 workers)")
            vr = rows.get("vllm-router (cache_aware)")
            if d and k1:
                ratio = (f", {max(k1[key], k2[key] if k2 else 0) / vr[key]:.2f}x vllm-router's req/s"
                         if vr and vr[key] else "")
                added = k1["c1_p50_ms"] - d["c1_p50_ms"]
                lines.append(f"{kind} {k1['mean_prompt_tokens']:.0f} tokens: +{added:.2f} ms p50{ratio}")
    mixed_k = out["mixed"].get("kvroute (1 worker)")
    tail = f"; small-request p99 beside cold big prompts {mixed_k['small_p99_ms']:.2f} ms" if mixed_k else ""
    print("kvroute added latency at 1 connection / throughput at "
          f"{args.connections}: " + "; ".join(lines) + tail)
    return 0


def stream_headline(rows: list[dict], args) -> int:
    """``--stream``'s last line: what kvroute adds to the first and the last byte at 1 connection, and
    its CPU per streamed answer and throughput at ``--connections`` against vllm-router's."""
    direct = rows[0]
    key, cpu = f"c{args.connections}_rps", f"c{args.connections}_cpu_us_per_request"
    vr = next((r for r in rows if r["target"].startswith("vllm-router") and r.get(key) and r.get(cpu)), None)
    parts = []
    for r in rows:
        if not r["target"].startswith("kvroute") or key not in r:
            continue
        text = (f"{r['target']}: +{r['c1_first_byte_p50_ms'] - direct['c1_first_byte_p50_ms']:.2f} ms to the first "
                f"byte, +{r['c1_p50_ms'] - direct['c1_p50_ms']:.2f} ms to the last, {r[cpu]:.0f} us CPU per answer")
        if vr:
            text += f" ({r[cpu] / vr[cpu]:.2f}x vllm-router's), {r[key] / vr[key]:.2f}x its answers/s"
        parts.append(text)
    print(f"streamed answers of {args.stream} events at 1 / {args.connections} connections: " + "; ".join(parts))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--skip", default="", help="comma-separated targets to skip")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--sizes", default="", help="comma-separated prompt sizes in tokens: chat requests at real sizes")
    ap.add_argument("--tokenizer", default="", help="model folder with tokenizer.json for --sizes")
    ap.add_argument("--kinds", default="chat,completion", help="with --sizes: chat, completion or both")
    ap.add_argument("--follow-up-gap", type=int, default=-1,
                    help="with --sizes: places between a follow-up and its previous turn (default twice "
                         "--connections; 0: the list before 2026-12-05, 40 conversations and no gap)")
    ap.add_argument("--mixed-windows", type=int, default=3, help="with --sizes: windows of --seconds of the last "
                    "measurement (small requests beside cold prompts), pooled")
    ap.add_argument("--stream", type=int, default=0,
                    help="small completions streamed, this many events per answer (0: whole answers)")
    ap.add_argument("--stream-gap-ms", type=float, default=1.0, help="with --stream: the backend's gap between events")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.role == "backend":
        run_backend(args.port, args.stream_gap_ms / 1000.0)
        return 0
    if args.role == "proxy-raw":
        run_raw_proxy(args.port, args.upstream)
        return 0
    if args.role == "proxy-asgi":
        run_asgi_proxy(args.port, args.upstream)
        return 0
    if args.role in ("proxy-aiohttp", "proxy-httpx", "proxy-kvroute"):
        run_bare_proxy(args.port, args.upstream, args.role.split("-")[1])
        return 0

    skip = set(filter(None, args.skip.split(",")))
    if args.sizes:
        args.skip = skip
        return sized(args)
    import uvloop  # noqa: F401  (the load generator runs on uvloop)
    asyncio.set_event_loop_policy(__import__("uvloop").EventLoopPolicy())
    procs: list[subprocess.Popen] = []
    rows = []
    requests = None
    if args.stream:  # the bare proxies read whole answers: only the routers stream
        skip |= {"proxy-aiohttp", "proxy-httpx", "proxy-kvroute", "proxy-asgi", "proxy-raw-1", "proxy-raw-2"}
        requests = [http_request("/v1/completions", json.dumps({**PROBE, "max_tokens": args.stream,
                                                                 "stream": True}).encode())]
    try:
        bport, upstream = start_backend(procs, args.stream_gap_ms)
        print(f"overhead bench: {args.seconds:.0f} s per measurement, {os.cpu_count()} CPUs, "
              f"static backend on :{bport}" + (f", answers streamed as {args.stream} events {args.stream_gap_ms:g} ms "
                                               "apart" if args.stream else ""))
        rows.append(measure("direct", bport, args, requests, procs=procs[:1]))

        # 2 workers with the booking bus (the default) and without it, to show what sharing costs
        for workers, bus in ((1, True), (2, True), (2, False)):
            if not bus and "no-bus" in skip:
                continue
            kport = free_port()
            pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
            kv = spawn([sys.executable, "-m", "router.cli", "serve", "--port", str(kport), "--pods", pods,
                        "--log-level", "error", "--workers", str(workers)],
                       env={**os.environ, "KVROUTE_BOOKING_BUS": "true" if bus else "false"})
            procs.append(kv)
            wait_ready(f"http://127.0.0.1:{kport}/ready", kv)
            if workers > 1:
                time.sleep(2.0)  # let every worker finish starting
            name = f"kvroute ({workers} worker{'s' if workers > 1 else ''}{'' if bus else ', no booking bus'})"
            rows.append(measure(name, kport, args, requests, procs=[kv]))
            stop_process(kv)

        venv = Path(args.peers_venv)
        for dist, name, cmd in peer_commands(venv, upstream):
            if dist in skip:
                continue
            if not Path(cmd[0]).exists():
                print(f"  {dist}: not installed in {venv} (see the docstring); row skipped")
                rows.append({"target": name, "error": "not installed"})
                continue
            version = peer_version(venv, dist)
            print(f"  {dist} {version} from {venv}")
            check_peer(dist, version)
            vport = free_port()
            vproc = spawn(cmd + ["--port", str(vport)])
            procs.append(vproc)
            try:
                wait_ready(f"http://127.0.0.1:{vport}/v1/completions", vproc, 60.0, body=PROBE)
                rows.append({**measure(name, vport, args, requests, procs=[vproc]), "version": version})
            except (RuntimeError, TimeoutError) as exc:
                print(f"  {dist}: could not run here: {exc}")
                rows.append({"target": name, "error": str(exc)[:200]})
            stop_process(vproc)

        for client in ("aiohttp", "httpx", "kvroute"):
            if f"proxy-{client}" in skip:
                continue
            pport = free_port()
            px = spawn([sys.executable, __file__, "--role", f"proxy-{client}", "--port", str(pport),
                        "--upstream", upstream])
            procs.append(px)
            wait_ready(f"http://127.0.0.1:{pport}/v1/completions", px, body=PROBE)
            rows.append(measure(f"bare FastAPI + {'kvroute client' if client == 'kvroute' else client}", pport, args,
                                procs=[px]))
            stop_process(px)

        if "proxy-asgi" not in skip:  # kvroute's server stack without its routing
            pport = free_port()
            px = spawn([sys.executable, __file__, "--role", "proxy-asgi", "--port", str(pport), "--upstream", upstream])
            procs.append(px)
            wait_ready(f"http://127.0.0.1:{pport}/v1/completions", px, body=PROBE)
            rows.append(measure("uvicorn + plain ASGI + kvroute client", pport, args, procs=[px]))
            stop_process(px)
        # the floor of any Python proxy here: no framework and no routing, in 1 and 2 processes
        for nprocs in (1, 2):
            if f"proxy-raw-{nprocs}" in skip:
                continue
            pport = free_port()
            floor_procs = [spawn([sys.executable, __file__, "--role", "proxy-raw", "--port", str(pport),
                                  "--upstream", upstream]) for _ in range(nprocs)]
            procs.extend(floor_procs)
            for px in floor_procs:
                wait_ready(f"http://127.0.0.1:{pport}/v1/completions", px, body=PROBE)
            time.sleep(0.5)
            rows.append(measure(f"raw Python proxy, {nprocs} process{'es' if nprocs > 1 else ''}", pport, args,
                                procs=floor_procs))
            for px in floor_procs:
                stop_process(px)
    finally:
        for p in procs:
            stop_process(p)
    if args.json:
        # the rows with the command and commit that made them (until 2026-12-06 a bare list of rows,
        # and the sized runs' object without either)
        Path(args.json).write_text(json.dumps({**stamp("overhead.py", args.argv), "rows": rows}, indent=2))
    if args.stream:
        return stream_headline(rows, args)
    direct = rows[0]
    kvr = next(r for r in rows if r["target"].startswith("kvroute (1"))
    kv2 = next((r for r in rows if r["target"].startswith("kvroute (2")), None)
    key = f"c{args.connections}_rps"
    vr = next((r for r in rows if r["target"].startswith("vllm-router") and r.get(key)), None)
    added = kvr["c1_p50_ms"] - direct["c1_p50_ms"]
    ratio = f"{kvr[key] / vr[key]:.2f}x vllm-router's {vr[key]:.0f}" if vr else "vllm-router not measured"
    two = f" (2 workers: {kv2[key]:.0f} req/s = {kv2[key] / vr[key]:.2f}x)" if kv2 and vr else ""
    floor_row = next((r for r in rows if r["target"].startswith("raw Python proxy, 1")), None)
    floor_text = (f"; a raw Python proxy {floor_row[key]:.0f} req/s = {floor_row[key] / vr[key]:.2f}x"
                  if floor_row and vr else "")
    print(f"kvroute added p50 latency {added:.3f} ms at 1 connection; {kvr[key]:.0f} req/s at "
          f"{args.connections} connections = {ratio}{two}{floor_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
