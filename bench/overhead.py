"""Gateway overhead: latency kvroute adds over calling a pod directly, and throughput through it.

Everything runs on this machine over loopback: a fast static backend (raw asyncio + httptools,
answering every completion with the same small JSON), and in front of it, one at a time, kvroute
(``kvroute serve``, one process), vllm-router (``cache_aware``) when it is installed, and two bare
FastAPI proxies, one on aiohttp and one on httpx, to re-measure the client-pool choice. The load
generator is also raw asyncio + httptools with pre-built requests, so it costs little CPU.

    python bench/overhead.py [--seconds 5] [--connections 32] [--peers-venv /tmp/peers-venv]

Prints one row per target: 1-connection p50/p99 latency and added p50 over direct, and 32-connection
throughput and p99. The last line is the headline. vllm-router is looked for in --peers-venv
(install it there with ``python -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install
vllm-router``; it is never a project dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fastapi import Request

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.testing import free_port, spawn, stop_process, wait_ready  # noqa: E402

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


class _Backend(asyncio.Protocol):
    R_COMPLETION = _response(b"200 OK", ANSWER)
    R_MODELS = _response(b"200 OK", MODELS)
    R_METRICS = _response(b"200 OK", METRICS, b"text/plain")
    R_EMPTY = _response(b"200 OK", b"{}")

    def connection_made(self, transport):
        import httptools

        self.t = transport
        self.url = b""
        self.parser = httptools.HttpRequestParser(self)

    def on_url(self, url):
        self.url = url

    def on_message_complete(self):
        u = self.url
        if u.startswith(b"/v1/completions") or u.startswith(b"/v1/chat/completions") or u.startswith(b"/generate"):
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


def run_backend(port: int) -> None:
    import uvloop

    async def main():
        server = await asyncio.get_running_loop().create_server(_Backend, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# ---------------------------------------------------------------------------------------------
# bare proxies (to compare client pools)
# ---------------------------------------------------------------------------------------------

def run_bare_proxy(port: int, upstream: str, client: str) -> None:
    import uvicorn
    from fastapi import FastAPI
    from starlette.responses import Response

    from contextlib import asynccontextmanager

    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        if client == "aiohttp":
            import aiohttp
            state["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        else:
            import httpx
            state["s"] = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                             max_keepalive_connections=None))
        yield
        await (state["s"].close() if client == "aiohttp" else state["s"].aclose())

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def proxy(request: Request):
        body = await request.body()
        if client == "aiohttp":
            async with state["s"].post(upstream + "/v1/completions", data=body,
                                       headers={"content-type": "application/json"}) as r:
                data = await r.read()
                return Response(data, status_code=r.status, media_type="application/json")
        r = await state["s"].post(upstream + "/v1/completions", content=body, headers={"content-type": "application/json"})
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="error",
                access_log=False)


# ---------------------------------------------------------------------------------------------
# the load generator
# ---------------------------------------------------------------------------------------------

class _Conn(asyncio.Protocol):
    def __init__(self, request: bytes, latencies: list[float], stop_at: float, done: asyncio.Future, errors: list):
        import httptools

        self.request, self.lat, self.stop_at, self.done, self.errors = request, latencies, stop_at, done, errors
        self.parser = httptools.HttpResponseParser(self)
        self.sent = 0.0

    def connection_made(self, transport):
        self.t = transport
        self._send()

    def _send(self):
        self.sent = time.perf_counter()
        self.t.write(self.request)

    def on_message_complete(self):
        now = time.perf_counter()
        if self.parser.get_status_code() != 200:
            self.errors.append(self.parser.get_status_code())
        self.lat.append(now - self.sent)
        if now < self.stop_at:
            self._send()
        elif not self.done.done():
            self.done.set_result(None)

    def data_received(self, data):
        self.parser.feed_data(data)

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(None)


async def load(port: int, connections: int, seconds: float, warmup: float = 0.5) -> dict:
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
    loop = asyncio.get_running_loop()
    # warm-up (connection pools, JIT-free but caches)
    w_lat: list[float] = []
    dones = []
    for _ in range(connections):
        fut = loop.create_future()
        await loop.create_connection(lambda: _Conn(request, w_lat, time.perf_counter() + warmup, fut, []),
                                     "127.0.0.1", port)
        dones.append(fut)
    await asyncio.gather(*dones)
    lat: list[float] = []
    errors: list = []
    dones, transports = [], []
    started = time.perf_counter()
    stop_at = started + seconds
    for _ in range(connections):
        fut = loop.create_future()
        t, _p = await loop.create_connection(lambda: _Conn(request, lat, stop_at, fut, errors), "127.0.0.1", port)
        dones.append(fut)
        transports.append(t)
    await asyncio.gather(*dones)
    elapsed = time.perf_counter() - started
    for t in transports:
        t.close()
    lat.sort()

    def q(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {"requests": len(lat), "errors": len(errors), "rps": len(lat) / elapsed, "p50_ms": q(0.5), "p99_ms": q(0.99),
            "mean_ms": statistics.fmean(lat) * 1000 if lat else float("nan")}


# ---------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------

def measure(name: str, port: int, args) -> dict:
    one = asyncio.run(load(port, 1, args.seconds))
    many = asyncio.run(load(port, args.connections, args.seconds))
    row = {"target": name, "c1_p50_ms": one["p50_ms"], "c1_p99_ms": one["p99_ms"], "c1_rps": one["rps"],
           f"c{args.connections}_rps": many["rps"], f"c{args.connections}_p99_ms": many["p99_ms"],
           "errors": one["errors"] + many["errors"]}
    print(f"  {name:<28} 1 conn: p50 {one['p50_ms']:.3f} ms p99 {one['p99_ms']:.3f} ms ({one['rps']:.0f} req/s)   "
          f"{args.connections} conn: {many['rps']:.0f} req/s p99 {many['p99_ms']:.2f} ms   errors {row['errors']}",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--peers-venv", default="/tmp/peers-venv")
    ap.add_argument("--skip", default="", help="comma-separated targets to skip")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "backend":
        run_backend(args.port)
        return 0
    if args.role in ("proxy-aiohttp", "proxy-httpx"):
        run_bare_proxy(args.port, args.upstream, args.role.split("-")[1])
        return 0

    skip = set(filter(None, args.skip.split(",")))
    import uvloop  # noqa: F401  (the load generator runs on uvloop)
    asyncio.set_event_loop_policy(__import__("uvloop").EventLoopPolicy())
    procs: list[subprocess.Popen] = []
    rows = []
    try:
        bport = free_port()
        backend = spawn([sys.executable, __file__, "--role", "backend", "--port", str(bport)])
        procs.append(backend)
        upstream = f"http://127.0.0.1:{bport}"
        wait_ready(f"{upstream}/health", backend)
        print(f"overhead bench: {args.seconds:.0f} s per measurement, {os.cpu_count()} CPUs, static backend on :{bport}")
        rows.append(measure("direct", bport, args))

        for workers in (1, 2):
            kport = free_port()
            pods = json.dumps([{"id": "pod-0", "url": upstream, "model": "sim-model"}])
            kv = spawn([sys.executable, "-m", "router.cli", "serve", "--port", str(kport), "--pods", pods,
                        "--log-level", "error", "--workers", str(workers)])
            procs.append(kv)
            wait_ready(f"http://127.0.0.1:{kport}/ready", kv)
            if workers > 1:
                time.sleep(2.0)  # let every worker finish starting
            rows.append(measure(f"kvroute ({workers} worker{'s' if workers > 1 else ''})", kport, args))
            stop_process(kv)

        peer = Path(args.peers_venv) / "bin" / "vllm-router"
        if "vllm-router" in skip:
            pass
        elif peer.exists():
            vport = free_port()
            vr = spawn([str(peer), "--port", str(vport), "--worker-urls", upstream, "--policy", "cache_aware",
                        "--log-level", "error", "--disable-retries", "--disable-circuit-breaker"])
            procs.append(vr)
            try:
                wait_ready(f"http://127.0.0.1:{vport}/v1/completions", vr, 60.0, body=PROBE)
                rows.append(measure("vllm-router (cache_aware)", vport, args))
            except (RuntimeError, TimeoutError) as exc:
                print(f"  vllm-router: could not run here: {exc}")
                rows.append({"target": "vllm-router (cache_aware)", "error": str(exc)[:200]})
            stop_process(vr)
        else:
            print(f"  vllm-router: not installed in {args.peers_venv} (see the docstring); row skipped")
            rows.append({"target": "vllm-router (cache_aware)", "error": "not installed"})

        for client in ("aiohttp", "httpx"):
            if f"proxy-{client}" in skip:
                continue
            pport = free_port()
            px = spawn([sys.executable, __file__, "--role", f"proxy-{client}", "--port", str(pport),
                        "--upstream", upstream])
            procs.append(px)
            wait_ready(f"http://127.0.0.1:{pport}/v1/completions", px, body=PROBE)
            rows.append(measure(f"bare FastAPI + {client}", pport, args))
            stop_process(px)
    finally:
        for p in procs:
            stop_process(p)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    direct = rows[0]
    kvr = next(r for r in rows if r["target"].startswith("kvroute (1"))
    kv2 = next((r for r in rows if r["target"].startswith("kvroute (2")), None)
    vr = next((r for r in rows if r["target"].startswith("vllm-router") and "c1_p50_ms" in r), None)
    key = f"c{args.connections}_rps"
    added = kvr["c1_p50_ms"] - direct["c1_p50_ms"]
    ratio = f"{kvr[key] / vr[key]:.2f}x vllm-router's {vr[key]:.0f}" if vr else "vllm-router not measured"
    two = f" (2 workers: {kv2[key]:.0f} req/s = {kv2[key] / vr[key]:.2f}x)" if kv2 and vr else ""
    print(f"kvroute added p50 latency {added:.3f} ms at 1 connection; {kvr[key]:.0f} req/s at "
          f"{args.connections} connections = {ratio}{two}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
