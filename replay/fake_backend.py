"""A minimal OpenAI-style streaming backend with known timing, for the replay client's tests and bench.

It answers ``/v1/completions`` and ``/v1/chat/completions`` with ``max_tokens`` SSE chunks: the
first after ``ttft`` seconds, the next ones ``itl`` seconds apart, then a usage chunk and
``[DONE]``; a request carrying ``x-fake-drop: K`` has its connection cut after K chunks. Every
``reject_every``-th request (or one carrying ``x-fake-status``) gets that error
status instead. Responses name a pod in ``x-kvroute-pod`` (round-robin over ``pods``), and
``/metrics`` exposes ``vllm:prefix_cache_queries_total``/``_hits_total`` counted with an
unbounded 16-token-block prefix cache, so hit rates are exactly predictable. Run it alone with
``python -m replay.fake_backend --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass
class Behaviour:
    ttft: float = 0.0
    itl: float = 0.0
    reject_every: int = 0  # every N-th request gets reject_status (0: never)
    reject_status: int = 429
    pods: tuple[str, ...] = ("pod-0",)
    block: int = 16
    count_cache: bool = True  # False: skip prompt parsing and cache accounting (fastest answers)
    tokens: int = 0  # answer with this many tokens instead of max_tokens (0: honour max_tokens)


@dataclass
class State:
    behaviour: Behaviour
    counter: itertools.count = field(default_factory=itertools.count)
    seen_blocks: set[bytes] = field(default_factory=set)
    queries: int = 0
    hits: int = 0
    requests: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)  # the first MAX_HEADERS requests' headers


def _prefix_hits(state: State, ids: list[int]) -> int:
    """Tokens of ``ids`` covered by leading full blocks seen before; records the new ones."""
    b = state.behaviour.block
    h = hashlib.blake2b(digest_size=16)
    hit_blocks = 0
    matching = True
    for j in range(len(ids) // b):
        h.update(orjson.dumps(ids[j * b:(j + 1) * b]))
        key = h.digest()
        if matching and key in state.seen_blocks:
            hit_blocks += 1
        else:
            matching = False
            state.seen_blocks.add(key)
    return hit_blocks * b


STATE_KEY = web.AppKey("state", State)
MAX_HEADERS = 10_000  # request headers kept for tests: the first ones only, so a long bench run stays small


def build_app(behaviour: Behaviour | None = None) -> web.Application:
    state = State(behaviour or Behaviour())
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = state

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="fake-model"}} {float(state.queries)}\n'
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="fake-model"}} {float(state.hits)}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def generate(request: web.Request) -> web.StreamResponse:
        beh = state.behaviour
        n = next(state.counter)
        state.requests += 1
        if len(state.headers) < MAX_HEADERS:
            state.headers.append(dict(request.headers))
        raw = await request.read()
        body = orjson.loads(raw) if beh.count_cache or not beh.tokens else {}
        pod = beh.pods[n % len(beh.pods)]
        forced = request.headers.get("x-fake-status")
        if forced or (beh.reject_every and (n + 1) % beh.reject_every == 0):
            status = int(forced) if forced else beh.reject_status
            return web.json_response({"error": {"message": "rejected", "type": "rate_limit", "code": status}},
                                     status=status, headers={"x-kvroute-pod": pod})
        chat = request.path.endswith("/chat/completions")
        if not beh.count_cache:
            ids, cached = [], 0
        elif chat:
            prompt = "".join(m.get("content", "") for m in body.get("messages", []))
            ids = list(prompt.encode())
        else:
            ids = body.get("prompt") or []
        if beh.count_cache:
            cached = _prefix_hits(state, ids)
            state.queries += len(ids)
            state.hits += cached
        tokens = beh.tokens or int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-kvroute-pod": pod})
        await resp.prepare(request)
        if beh.ttft:
            await asyncio.sleep(beh.ttft)
        drop_after = int(request.headers.get("x-fake-drop", "-1"))
        for i in range(tokens):
            if i == drop_after and request.transport is not None:  # cut the stream: the client must fail it
                request.transport.close()
                return resp
            if i and beh.itl:
                await asyncio.sleep(beh.itl)
            choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
            await resp.write(b"data: " + orjson.dumps({"id": f"r{n}", "choices": [choice]}) + b"\n\n")
        usage = {"prompt_tokens": len(ids), "completion_tokens": tokens, "total_tokens": len(ids) + tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await resp.write(b"data: " + orjson.dumps({"id": f"r{n}", "choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


async def start(port: int, behaviour: Behaviour | None = None, host: str = "127.0.0.1") -> web.AppRunner:
    """Start the backend inside the running loop; ``await runner.cleanup()`` stops it."""
    runner = web.AppRunner(build_app(behaviour), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft", type=float, default=0.0)
    parser.add_argument("--itl", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=0, help="answer with this many tokens (0: max_tokens)")
    parser.add_argument("--no-cache-stats", action="store_true", help="skip prompt parsing and cache accounting")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(build_app(Behaviour(ttft=args.ttft, itl=args.itl, tokens=args.tokens,
                                       count_cache=not args.no_cache_stats)), host=args.host, port=args.port,
                access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
