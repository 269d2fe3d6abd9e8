"""The sidecar as a real process between real HTTP servers: leg bodies, fallbacks, SSRF, streaming, cancel.

The prefill and decode pods here are small aiohttp servers (in a thread of the test process) that
record every request they receive, so each test can check the exact bytes and headers of each leg
and steer the pods' answers (errors, delays, a null ``kv_transfer_params``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
import time

import httpx
import openai
import pytest
from aiohttp import web

from tests.helpers import free_port, free_ports, kvroute_process, metric

GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
P_PARAMS_EXTRA = {"remote_request_id": "p-internal-7", "tp_size": 1, "future_field": {"nested": [1, 2]}}


class FakePod:
    """A recording vLLM stand-in: prefill role when asked ``do_remote_decode``, decode role otherwise."""

    def __init__(self, name: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self.name = name
        self.ssl_context = ssl_context
        self.port = free_port()
        self.received: list[dict] = []
        self.events: list[str] = []
        self.behaviour: dict = {}
        self.published: list[str] = []
        self.polls = 0
        self.gate: threading.Event | None = None
        self.gate_ping = False  # while gated, send an SSE comment every 0.2 s
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port,
                                                     ssl_context=self.ssl_context).start())
        self._ready.set()
        self.loop.run_forever()

    def start(self) -> FakePod:
        self._ready = threading.Event()
        self.thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.set()
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def reset(self) -> None:
        self.received.clear()
        self.events.clear()
        self.behaviour = {}
        self.gate = None
        self.gate_ping = False

    def wait_event(self, name: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if name in self.events:
                return True
            time.sleep(0.02)
        return False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if request.path == "/internal/prefill-pods":  # allowlist polls are not requests under test
            self.polls += 1
            return web.json_response(self.published)
        self.received.append({"method": request.method, "path": request.path, "query": request.query_string,
                              "headers": [(k.lower(), v) for k, v in request.headers.items()],
                              "raw": raw, "json": body})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        if request.path not in GENERATION:
            return web.json_response({"echo": request.path, "query": request.query_string})
        b = self.behaviour
        try:
            if b.get("delay"):
                await asyncio.sleep(b["delay"])
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise
        if b.get("status"):
            return web.Response(status=b["status"], content_type="application/json",
                                body=json.dumps({"error": {"message": f"{self.name} says no", "type": "X",
                                                           "param": None, "code": b["status"]}}))
        params = (body or {}).get("kv_transfer_params") or {}
        if params.get("do_remote_decode") and "answer" in b:
            return await self._answer(request, b)
        if params.get("do_remote_decode") and b.get("garbage"):
            return web.Response(status=200, content_type="application/json", body=b"<html>oops</html>")
        if params.get("do_remote_decode"):
            answer = {"id": "cmpl-p", "object": "text_completion", "model": "fake-model",
                      "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
            if b.get("params") != "missing":
                answer["kv_transfer_params"] = None if b.get("params") == "null" else {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
                    "remote_engine_id": f"engine-{self.name}", "remote_host": "127.0.0.1",
                    "remote_port": self.port, **P_PARAMS_EXTRA}
            return web.json_response(answer)
        if body and body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i in range(3):
                    chunk = {"id": "cmpl-d", "object": "chat.completion.chunk", "model": "fake-model",
                             "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]}
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    if i == 0:
                        self.events.append("first_chunk")
                    if i == 0 and b.get("drop"):
                        if b.get("drop") == "inside":  # half the next event: the break falls inside it
                            await resp.write(b'data: {"id": "cmpl-d", "object": "chat.comp')
                        # a moment first: aiohttp's reader raises a broken connection's error before the
                        # data it still buffers, so a chunk and the close read together lose the chunk
                        await asyncio.sleep(0.1)
                        request.transport.close()
                        self.events.append("dropped")
                        return resp
                    if i == 0 and self.gate is not None:
                        while not self.gate.is_set():
                            if self.gate_ping:  # an SSE comment now and then: held, but not silent
                                await resp.write(b": ping\n\n")
                                await asyncio.sleep(0.2)
                            await asyncio.sleep(0.01)
                await resp.write(b"data: [DONE]\n\n")
            except (asyncio.CancelledError, ConnectionResetError):
                self.events.append("stream_cancelled")
                raise
            return resp
        if request.path == "/v1/chat/completions":
            return web.json_response({
                "id": "chatcmpl-d", "object": "chat.completion", "model": "fake-model", "kv_transfer_params": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "decoded"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        return web.json_response({"id": "cmpl-d", "object": "text_completion", "model": "fake-model",
                                  "kv_transfer_params": None,
                                  "choices": [{"index": 0, "text": "decoded", "finish_reason": "stop"}]})


    async def _answer(self, request: web.Request, b: dict) -> web.StreamResponse:
        """The prefill's answer as given: ``answer`` bytes, ``answer_status``, ``answer_headers``; with
        ``chunked``, written 64 KiB at a time (no Content-Length), "answer_cut" noted if the reader leaves."""
        status = b.get("answer_status", 200)
        headers = b.get("answer_headers", {"Content-Type": "application/json"})
        if not b.get("chunked"):
            return web.Response(status=status, body=b["answer"], headers=headers)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        try:
            for i in range(0, len(b["answer"]), 65536):
                await resp.write(b["answer"][i:i + 65536])
                await asyncio.sleep(0.01)
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.events.append("answer_cut")
            raise
        return resp


def header(record: dict, name: str) -> list[str]:
    return [v for k, v in record["headers"] if k == name]


@pytest.fixture(scope="module")
def pods():
    prefill, decode = FakePod("p").start(), FakePod("d").start()
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def sidecar(pods):
    """The main sidecar: allowlist 127.0.0.1 (any port), fallback on, a short prefill timeout."""
    _, decode = pods
    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decode.url,
            "--prefill-allowlist", json.dumps(["127.0.0.1", "10.0.0.0/8"]), "--prefill-timeout", "1"]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def _clean(pods):
    for pod in pods:
        pod.reset()
    yield


def chat_body(**extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}], **extra}


def test_both_legs_carry_the_exact_bodies_and_one_request_id(pods, sidecar):
    prefill, decode = pods
    body = chat_body(stream=False, max_tokens=20, max_completion_tokens=20, min_tokens=2, min_completion_tokens=2,
                     temperature=0.5)
    r = httpx.post(sidecar + "/v1/chat/completions", json=body, timeout=10,
                   headers=[("x-prefiller-host-port", f"127.0.0.1:{prefill.port}, 127.0.0.1:1"),
                            ("x-prefiller-host-port", "127.0.0.1:2"),
                            ("x-request-id", "req-abc"), ("authorization", "Bearer k"),
                            ("x-data-parallel-rank", "3")])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "decoded"
    assert r.headers["x-request-id"] == "req-abc"
    assert r.headers["x-kvroute-prefill"] == "remote"
    assert float(r.headers["x-kvroute-prefill-ms"]) > 0

    (p_rec,) = prefill.received
    assert p_rec["path"] == "/v1/chat/completions"
    expected_p = {k: v for k, v in body.items() if k not in ("min_tokens", "min_completion_tokens")}
    expected_p.update(stream=False, max_tokens=1, max_completion_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    assert p_rec["json"] == expected_p
    assert header(p_rec, "x-request-id") == ["req-abc"]
    assert header(p_rec, "authorization") == ["Bearer k"]
    assert header(p_rec, "x-prefiller-host-port") == []
    assert header(p_rec, "x-data-parallel-rank") == []  # the rank names a decode engine (the router's choice)

    (d_rec,) = decode.received
    sent_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
                   "remote_engine_id": "engine-p", "remote_host": "127.0.0.1", "remote_port": prefill.port,
                   **P_PARAMS_EXTRA}
    assert d_rec["json"] == {**body, "kv_transfer_params": sent_params}
    assert header(d_rec, "x-request-id") == ["req-abc"]
    assert header(d_rec, "authorization") == ["Bearer k"]
    assert header(d_rec, "x-prefiller-host-port") == []
    assert header(d_rec, "x-data-parallel-rank") == ["3"]


def test_request_id_is_made_when_absent_and_legacy_header_works(pods, sidecar):
    prefill, decode = pods
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 4,
                                                      "stream_options": {"include_usage": True}},
                   headers={"x-prefiller-url": f"http://127.0.0.1:{prefill.port}"}, timeout=10)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert len(rid) >= 16
    assert header(prefill.received[0], "x-request-id") == [rid]
    assert header(decode.received[0], "x-request-id") == [rid]
    assert "stream_options" not in prefill.received[0]["json"]
    assert "max_completion_tokens" not in prefill.received[0]["json"]
    assert decode.received[0]["json"]["stream_options"] == {"include_usage": True}
    assert header(decode.received[0], "x-prefiller-url") == []


def test_llm_ds_prefixed_prefill_header_is_honoured_and_not_forwarded(pods, sidecar):
    """llm-d's scheduler writes ``x-llm-d-prefiller-host-port`` (a comma-separated list: the first is
    used unless --prefill-sampling); the sidecar takes it, checks it against the allowlist like the
    others, and passes neither it nor a bad first entry's siblings to the decoder."""
    prefill, decode = pods
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 4},
                   headers={"x-llm-d-prefiller-host-port": f"127.0.0.1:{prefill.port}, 192.0.2.1:1"}, timeout=10)
    assert r.status_code == 200, r.text
    assert len(prefill.received) == 1 and prefill.received[0]["json"]["max_tokens"] == 1
    assert header(decode.received[0], "x-llm-d-prefiller-host-port") == []
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 4},
                   headers={"x-llm-d-prefiller-host-port": f"192.0.2.1:1, 127.0.0.1:{prefill.port}"}, timeout=10)
    assert r.status_code == 403 and "allowlist" in r.json()["error"]["message"], r.text
    assert len(prefill.received) == 1


def test_streaming_passes_through_chunk_by_chunk(pods, sidecar):
    prefill, decode = pods
    decode.gate = threading.Event()  # the decoder holds its later chunks until the client has the first
    with httpx.stream("POST", sidecar + "/v1/chat/completions", json=chat_body(stream=True, max_tokens=3),
                      headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert "tok0" in first
        decode.gate.set()
        rest = [line for line in lines if line]
    assert [json.loads(x[6:])["choices"][0]["delta"]["content"] for x in rest[:-1]] == ["tok1 ", "tok2 "]
    assert rest[-1] == "data: [DONE]"
    assert prefill.received[0]["json"]["stream"] is False
    assert decode.received[0]["json"]["stream"] is True
    assert decode.received[0]["json"]["kv_transfer_params"]["remote_engine_id"] == "engine-p"


def test_openai_sdk_streams_through_both_legs(pods, sidecar):
    prefill, decode = pods
    client = openai.OpenAI(base_url=sidecar + "/v1", api_key="k", max_retries=0, timeout=10)
    stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, stream=True,
                                            extra_headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == "tok0 tok1 tok2 "
    assert len(prefill.received) == 1 and len(decode.received) == 1


def test_eos_on_the_first_token_decodes_without_params(pods, sidecar):
    prefill, decode = pods
    before = metric(sidecar, "kvroute_sidecar_prefill_without_kv_transfer_params_total")
    for mode in ("null", "missing"):
        prefill.behaviour = {"params": mode}
        r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p", "max_tokens": 5},
                       headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-prefill"] == "local"
        assert "kv_transfer_params" not in decode.received[-1]["json"]
    assert metric(sidecar, "kvroute_sidecar_prefill_without_kv_transfer_params_total") == before + 2


def test_prefill_4xx_goes_back_as_it_is(pods, sidecar):
    prefill, decode = pods
    prefill.behaviour = {"status": 400}
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p", "min_tokens": 9},
                   headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "p says no"
    assert decode.received == []


@pytest.mark.parametrize("fault", ["status_500", "connection_refused", "timeout"])
def test_prefill_failure_falls_back_to_local_prefill(pods, sidecar, fault):
    prefill, decode = pods
    target = f"127.0.0.1:{prefill.port}"
    reason = {"status_500": "server_error", "connection_refused": "connect_error", "timeout": "timeout"}[fault]
    if fault == "status_500":
        prefill.behaviour = {"status": 500}
    elif fault == "timeout":
        prefill.behaviour = {"delay": 3}
    else:
        target = f"127.0.0.1:{free_port()}"
    before = metric(sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason=reason)
    body = {"model": "fake-model", "prompt": "p", "max_tokens": 5, "kv_transfer_params": {"remote_host": "x"}}
    r = httpx.post(sidecar + "/v1/completions", json=body, headers={"x-prefiller-host-port": target}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "decoded"
    assert r.headers["x-kvroute-prefill"] == "fallback"
    (d_rec,) = decode.received
    assert d_rec["json"] == {"model": "fake-model", "prompt": "p", "max_tokens": 5}
    assert metric(sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason=reason) == before + 1


def test_no_header_passes_the_request_as_it_is(pods, sidecar):
    prefill, decode = pods
    raw = b'{"model":"fake-model","prompt":"as is",  "max_tokens":2}'
    r = httpx.post(sidecar + "/v1/completions", content=raw, timeout=10,
                   headers={"content-type": "application/json", "x-request-id": "keep-me"})
    assert r.status_code == 200
    assert decode.received[0]["raw"] == raw
    assert header(decode.received[0], "x-request-id") == ["keep-me"]
    assert prefill.received == []


def test_client_kv_transfer_params_are_stripped_by_default(pods, sidecar):
    _, decode = pods
    smuggled = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80}
    r = httpx.post(sidecar + "/v1/completions", timeout=10,
                   json={"model": "fake-model", "prompt": "p", "kv_transfer_params": smuggled})
    assert r.status_code == 200
    assert decode.received[0]["json"] == {"model": "fake-model", "prompt": "p"}


@pytest.mark.parametrize("two_legs", [True, False], ids=["two legs", "straight"])
def test_client_kv_transfer_params_under_vllm_xargs_are_stripped(pods, sidecar, two_legs):
    """vLLM builds the engine's extra_args from ``vllm_xargs`` and lets a top-level kv_transfer_params
    override the nested one only when it is truthy: ``{"vllm_xargs": {"kv_transfer_params": []}}``
    reached a NIXL engine's connector and stopped vLLM 0.32's engine core. Dropped on both paths; the
    rest of ``vllm_xargs`` goes on."""
    prefill, decode = pods
    decode.reset()
    headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"} if two_legs else {}
    r = httpx.post(sidecar + "/v1/completions", timeout=10, headers=headers,
                   json={"model": "fake-model", "prompt": "p", "vllm_xargs": {"kv_transfer_params": [], "k": 1}})
    assert r.status_code == 200, r.text
    got = decode.received[-1]["json"]
    assert got["vllm_xargs"] == {"k": 1}
    assert ("kv_transfer_params" in got) == two_legs  # the prefill pod's own, on the two-leg path


def test_other_paths_are_proxied_and_own_endpoints_answer(pods, sidecar):
    _, decode = pods
    assert httpx.get(sidecar + "/v1/models", timeout=5).json()["data"][0]["id"] == "fake-model"
    echo = httpx.post(sidecar + "/tokenize?x=1&y=2", json={"prompt": "a"}, timeout=5).json()
    assert echo == {"echo": "/tokenize", "query": "x=1&y=2"}
    assert httpx.get(sidecar + "/health", timeout=5).status_code == 200
    text = httpx.get(sidecar + "/metrics", timeout=5).text
    assert "kvroute_sidecar_legs_total" in text
    assert [r["path"] for r in decode.received] == ["/v1/models", "/tokenize"]


@pytest.mark.parametrize("target", [
    "127.0.0.2:{port}",            # an IP not in the list
    "2130706434:{port}",           # 127.0.0.2, decimal
    "0x7f000002:{port}",           # 127.0.0.2, hex
    "0177.0.0.2:{port}",           # 127.0.0.2, octal
    "127.2:{port}",                # 127.0.0.2, short form
    "0xa9fea9fe:80",               # 169.254.169.254 (cloud metadata), hex
    "[::1]:{port}",                # IPv6 loopback is not 127.0.0.1
    "[::ffff:169.254.169.254]:80",  # IPv4-mapped IPv6
    "[::ffff:7f00:2]:{port}",      # IPv4-mapped 127.0.0.2, hex groups
    "http://169.254.169.254:80",   # URL form
])
def test_ssrf_targets_outside_the_allowlist_are_refused(pods, sidecar, target):
    prefill, decode = pods
    before = metric(sidecar, "kvroute_sidecar_ssrf_rejections_total", reason="not_allowed")
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                   headers={"x-prefiller-host-port": target.format(port=prefill.port)}, timeout=10)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == 403 and "allowlist" in err["message"]
    assert prefill.received == [] and decode.received == []
    assert metric(sidecar, "kvroute_sidecar_ssrf_rejections_total", reason="not_allowed") == before + 1


@pytest.mark.parametrize("target", ["2130706433:{port}", "0x7f.1:{port}", "[::ffff:127.0.0.1]:{port}",
                                    "localhost:{port}"])
def test_other_spellings_of_an_allowed_address_reach_it(pods, sidecar, target):
    prefill, decode = pods
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                   headers={"x-prefiller-host-port": target.format(port=prefill.port)}, timeout=10)
    assert r.status_code == 200, r.text
    assert len(prefill.received) == 1 and len(decode.received) == 1


@pytest.mark.parametrize("target", ["", "127.0.0.1", "evil@127.0.0.1:80", "127.0.0.1:80/x", "999.0.0.1:80",
                                    "[fe80::1%25eth0]:80", "ftp://127.0.0.1:21", "host:99999"])
def test_malformed_targets_are_a_clear_400(pods, sidecar, target):
    prefill, decode = pods
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                   headers={"x-prefiller-host-port": target}, timeout=10)
    assert r.status_code == 400, r.text
    assert "prefill target" in r.json()["error"]["message"]
    assert prefill.received == [] and decode.received == []


def test_bad_json_with_a_prefill_header_is_a_400(pods, sidecar):
    prefill, _ = pods
    r = httpx.post(sidecar + "/v1/completions", content=b"{not json", timeout=10,
                   headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}", "content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"


def test_client_disconnect_mid_prefill_cancels_the_prefill_request(pods, sidecar):
    prefill, decode = pods
    prefill.behaviour = {"delay": 0.9}
    before = metric(sidecar, "kvroute_sidecar_legs_total", leg="prefill", outcome="cancelled")
    left = metric(sidecar, "kvroute_sidecar_requests_total", mode="client_disconnected")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                   headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=0.3)
    assert prefill.wait_event("cancelled", timeout=3), prefill.events
    time.sleep(0.9)  # past the prefill's own delay: no decode leg may start afterwards
    assert decode.received == []
    assert metric(sidecar, "kvroute_sidecar_legs_total", leg="prefill", outcome="cancelled") == before + 1
    assert metric(sidecar, "kvroute_sidecar_requests_total", mode="client_disconnected") == left + 1


def test_client_disconnect_mid_stream_cancels_the_decode_request(pods, sidecar):
    prefill, decode = pods
    decode.gate = threading.Event()  # never set: the decoder stalls after its first chunk
    with httpx.stream("POST", sidecar + "/v1/chat/completions", json=chat_body(stream=True),
                      headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10) as r:
        first = next(line for line in r.iter_lines() if line)
        assert "tok0" in first
    assert decode.wait_event("stream_cancelled", timeout=3), decode.events


@pytest.mark.parametrize(("stream", "params"), [(True, True), (False, True), (True, False)])
def test_a_client_that_leaves_before_the_decoders_first_chunk(pods, sidecar, stream, params):
    """A streamed decode leg that carries the prefill's params is cut only once the decoder's first chunk
    has come (the engine has then read the blocks, which frees them on the prefill pod; cut before, vLLM
    can lose the request and the prefill pod holds the blocks for its whole lease). Other decode legs are
    cut at once."""
    prefill, decode = pods
    if not params:
        prefill.behaviour = {"params": "null"}
    decode.behaviour = {"delay": 0.8}  # the decoder answers (headers, then chunks) 0.8 s after the request
    cancelled = metric(sidecar, "kvroute_sidecar_legs_total", leg="decode", outcome="cancelled")
    left = metric(sidecar, "kvroute_sidecar_requests_total", mode="client_disconnected")
    with pytest.raises(httpx.ReadTimeout):  # the client leaves while the decode leg waits for its answer
        httpx.post(sidecar + "/v1/chat/completions", json=chat_body(stream=stream),
                   headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=0.4)
    assert decode.received and ("kv_transfer_params" in decode.received[0]["json"]) == params
    if stream and params:
        assert decode.wait_event("first_chunk", timeout=5), decode.events
        assert "cancelled" not in decode.events
    else:
        assert decode.wait_event("cancelled", timeout=5), decode.events
        assert "first_chunk" not in decode.events
    assert metric(sidecar, "kvroute_sidecar_legs_total", leg="decode", outcome="cancelled") == cancelled + 1
    assert metric(sidecar, "kvroute_sidecar_requests_total", mode="client_disconnected") == left + 1


@pytest.fixture(scope="module")
def published_sidecar(pods):
    """A sidecar whose allowlist is the published prefill set; no fallback; 1 s decode timeout; small bodies."""
    prefill, decode = pods
    prefill.published = [f"127.0.0.1:{prefill.port}"]
    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decode.url,
            "--prefill-allowlist-url", prefill.url + "/internal/prefill-pods", "--allowlist-refresh-s", "0.2",
            "--target-dns-cache-s", "0", "--no-fallback-on-prefill-error", "--decode-timeout", "1",
            "--max-body-bytes", "100000"]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def _wait_allowed(base: str, target: str, want: int) -> httpx.Response:
    deadline = time.monotonic() + 5
    while True:
        r = httpx.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                       headers={"x-prefiller-host-port": target}, timeout=10)
        if r.status_code == want or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_published_prefill_set_is_the_allowlist_and_ports_matter(pods, published_sidecar):
    prefill, decode = pods
    prefill.published = [f"127.0.0.1:{prefill.port}"]
    assert _wait_allowed(published_sidecar, f"127.0.0.1:{prefill.port}", 200).status_code == 200
    other = free_port()
    assert _wait_allowed(published_sidecar, f"127.0.0.1:{other}", 403).status_code == 403
    # a name that resolves to an address outside the set is refused
    prefill.published = [f"127.0.0.2:{prefill.port}"]
    assert _wait_allowed(published_sidecar, f"localhost:{prefill.port}", 403).status_code == 403
    # names in the published set are resolved
    prefill.published = [f"localhost:{prefill.port}"]
    assert _wait_allowed(published_sidecar, f"127.0.0.1:{prefill.port}", 200).status_code == 200
    assert metric(published_sidecar, "kvroute_sidecar_allowlist_entries") == 1
    assert prefill.polls >= 3  # fetched at start, then refreshed for each of the two changes above


def test_without_fallback_a_prefill_5xx_is_returned(pods, published_sidecar):
    prefill, decode = pods
    prefill.published = [f"127.0.0.1:{prefill.port}"]
    _wait_allowed(published_sidecar, f"127.0.0.1:{prefill.port}", 200)
    decode.reset()
    prefill.behaviour = {"status": 503}
    r = httpx.post(published_sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                   headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "p says no"
    assert decode.received == []


def test_a_failed_prefill_leg_tells_the_client_what_failed_not_where(pods, published_sidecar):
    """Without fallback a prefill pod that cannot be reached is the client's 502: it named the pod's
    address (``prefill at 127.0.0.1:<port> failed: Cannot connect to host ...``), which reached a
    tenant through the router; the address goes to the sidecar's log only."""
    prefill, _ = pods
    dead = free_port()
    prefill.published = [f"127.0.0.1:{dead}"]
    r = _wait_allowed(published_sidecar, f"127.0.0.1:{dead}", 502)
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert message == "the prefill leg failed: the prefill pod could not be reached"
    assert "127.0.0.1" not in r.text and str(dead) not in r.text
    prefill.published = [f"127.0.0.1:{prefill.port}"]


def test_unreachable_decoder_is_a_503_and_own_health_stays_up():
    port, dead = free_ports(2)
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", f"http://127.0.0.1:{dead}"]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health"):
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "p"}, timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailable"
        # SSRF protection is on by default and nothing is allowlisted: any prefill target is refused
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "p"}, timeout=10,
                       headers={"x-prefiller-host-port": "127.0.0.1:8000"})
        assert r.status_code == 403
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        assert metric(base, "kvroute_sidecar_legs_total", leg="direct", outcome="connect_error") == 1


def test_unusable_prefill_answer_falls_back(pods, sidecar):
    prefill, decode = pods
    prefill.behaviour = {"garbage": True}
    before = metric(sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason="bad_response")
    r = httpx.post(sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                   headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10)
    assert r.status_code == 200
    assert "kv_transfer_params" not in decode.received[0]["json"]
    assert metric(sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason="bad_response") == before + 1


def test_a_broken_decoder_stream_ends_with_an_sse_error(pods, sidecar):
    prefill, decode = pods
    decode.behaviour = {"drop": True}
    with httpx.stream("POST", sidecar + "/v1/chat/completions", json=chat_body(stream=True),
                      headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert "tok0" in lines[0]
    assert json.loads(lines[-2][6:])["error"]["type"] == "InternalServerError"
    assert lines[-1] == "data: [DONE]"
    assert metric(sidecar, "kvroute_sidecar_legs_total", leg="decode", outcome="stream_error") >= 1


def test_a_decoder_stream_broken_inside_an_event_ends_with_whole_events(pods, sidecar):
    """The decoder's last bytes are half an event: the client gets the events before it and then the
    sidecar's error event, each whole (the half event never reaches it, to run into the error)."""
    prefill, decode = pods
    decode.behaviour = {"drop": "inside"}
    with httpx.stream("POST", sidecar + "/v1/chat/completions", json=chat_body(stream=True),
                      headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=10) as r:
        assert r.status_code == 200
        raw = r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert len(events) == 3 and all(e.startswith(b"data: ") for e in events), raw
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "tok0 "
    assert json.loads(events[1][6:])["error"]["type"] == "InternalServerError"
    assert events[2] == b"data: [DONE]"


def test_a_decoder_stream_broken_on_the_messages_route_ends_with_anthropics_error_event(pods, sidecar):
    """A Messages stream goes to the decode engine whole; broken there, it ends with vLLM's own
    ``event: error`` (Anthropic's SDK skips an event with no name) and no ``[DONE]``."""
    prefill, decode = pods
    decode.behaviour = {"drop": "inside"}
    body = {"model": "fake-model", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", sidecar + "/v1/messages", json=body, timeout=10) as r:
        assert r.status_code == 200
        raw = r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert len(events) == 2 and events[0].startswith(b"data: "), raw
    name, data = events[1].split(b"\n")
    assert name == b"event: error"
    error = json.loads(data.removeprefix(b"data: "))
    assert error["type"] == "error" and error["error"]["type"] == "internal_error"
    assert error["error"]["message"].startswith("the decoder stream broke")
    assert not prefill.received and [rec["path"] for rec in decode.received] == ["/v1/messages"]


async def test_many_concurrent_streams_through_both_legs(pods, sidecar):
    prefill, decode = pods
    n = 40

    async def one(client: httpx.AsyncClient, i: int) -> str:
        async with client.stream("POST", sidecar + "/v1/chat/completions", json=chat_body(stream=True, user=str(i)),
                                 headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}",
                                          "x-request-id": f"r{i}"}) as r:
            assert r.status_code == 200
            assert r.headers["x-request-id"] == f"r{i}"
            return "".join([line async for line in r.aiter_lines() if line])

    async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=n)) as client:
        bodies = await asyncio.gather(*(one(client, i) for i in range(n)))
    assert all(b.count("tok") == 3 and b.endswith("data: [DONE]") for b in bodies)
    assert sorted(header(r, "x-request-id")[0] for r in prefill.received) == sorted(f"r{i}" for i in range(n))
    for rec in decode.received:  # each decode leg carries the request id its own prefill leg had
        assert rec["json"]["user"] == header(rec, "x-request-id")[0][1:]


def test_a_silent_decoder_hits_the_decode_timeout(pods, published_sidecar):
    _, decode = pods
    decode.behaviour = {"delay": 3}
    r = httpx.post(published_sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"}, timeout=10)
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "GatewayTimeout"
    decode.reset()
    decode.gate = threading.Event()  # stalls after the first chunk, longer than the 1 s decode timeout
    with httpx.stream("POST", published_sidecar + "/v1/chat/completions", json=chat_body(stream=True),
                      timeout=10) as r:
        lines = [line for line in r.iter_lines() if line]
    assert "tok0" in lines[0] and lines[-1] == "data: [DONE]" and "error" in lines[-2]


def test_an_oversized_body_is_a_413(pods, published_sidecar):
    _, decode = pods
    r = httpx.post(published_sidecar + "/v1/completions", timeout=10,
                   json={"model": "fake-model", "prompt": "x" * 200_000})
    assert r.status_code == 413
    err = r.json()["error"]
    assert "larger than" in err["message"] and err["type"] == "RequestTooLargeError"
    assert decode.received == []


def make_certificate(folder) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost: (cert path, key path)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_tls_on_the_listener(pods, tmp_path):
    prefill, decode = pods
    cert, key = make_certificate(tmp_path)
    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decode.url,
            "--prefill-allowlist", '["127.0.0.1"]', "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    with kvroute_process(args):
        base = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                               verify=ssl.create_default_context(cafile=str(cert)),
                               headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}, timeout=5)
                break
            except httpx.ConnectError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert r.status_code == 200
        assert len(prefill.received) == 1 and len(decode.received) == 1
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_https_prefill_legs_verify_the_certificate(pods, tmp_path):
    _, decode = pods
    cert, key = make_certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    secure = FakePod("tls", ssl_context=context).start()
    ports = free_ports(2)
    common = ["sidecar", "--host", "127.0.0.1", "--vllm-url", decode.url, "--prefill-allowlist", '["127.0.0.1"]',
              "--prefill-scheme", "https"]
    try:
        with kvroute_process([*common, "--port", str(ports[0]), "--prefill-ca-file", cert],
                             ready_url=f"http://127.0.0.1:{ports[0]}/health"), \
                kvroute_process([*common, "--port", str(ports[1])], ready_url=f"http://127.0.0.1:{ports[1]}/health"):
            trusting, untrusting = (f"http://127.0.0.1:{p}" for p in ports)
            for target in (f"127.0.0.1:{secure.port}", f"localhost:{secure.port}"):
                r = httpx.post(trusting + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                               headers={"x-prefiller-host-port": target}, timeout=10)
                assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "remote", r.text
                assert header(secure.received[-1], "host") == [target]
            assert decode.received[-1]["json"]["kv_transfer_params"]["remote_engine_id"] == "engine-tls"
            # the system CAs do not know this certificate: the prefill leg fails and the decoder prefills
            r = httpx.post(untrusting + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                           headers={"x-prefiller-host-port": f"localhost:{secure.port}"}, timeout=10)
            assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "fallback"
            assert metric(untrusting, "kvroute_sidecar_prefill_fallbacks_total", reason="connect_error") == 1
            assert len(secure.received) == 2
    finally:
        secure.stop()


def _pd(base: str, prefill: FakePod, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(base + path, json=body, headers={"x-prefiller-host-port": f"127.0.0.1:{prefill.port}"},
                      timeout=10)


def _answer(params_json: bytes) -> bytes:
    """A prefill answer whose kv_transfer_params are ``params_json``, as raw bytes."""
    return b'{"id":"cmpl-p","choices":[{"index":0,"text":"x"}],"kv_transfer_params":' + params_json + b"}"


def test_a_prefill_content_type_outside_latin_1_is_no_500(pods, sidecar):
    prefill, decode = pods
    prefill.behaviour = {"answer": _answer(b'{"remote_engine_id":"e"}'),
                         "answer_headers": {"Content-Type": "application/json; charset=\u20ac"}}
    r = _pd(sidecar, prefill, {"model": "fake-model", "prompt": "p"})
    assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "remote", r.text
    assert decode.received[-1]["json"]["kv_transfer_params"] == {"remote_engine_id": "e"}
    prefill.behaviour = {"answer": b'{"error":{"message":"no"}}', "answer_status": 400,
                         "answer_headers": {"Content-Type": "application/json; x=\u20ac"}}
    r = _pd(sidecar, prefill, {"model": "fake-model", "prompt": "p"})
    assert r.status_code == 400 and r.json() == {"error": {"message": "no"}}
    assert r.headers["content-type"] == "application/json; x=?"
    assert len(decode.received) == 1


def test_prefill_params_reach_the_decoder_as_the_engine_reads_them(pods, sidecar):
    """Params orjson cannot carry (an integer beyond 64 bits, NaN, 300 levels deep) pass exactly; params
    nested deeper than any writer goes are an unusable answer, so the decoder prefills."""
    prefill, decode = pods
    deep = b"[" * 300 + b"]" * 300
    prefill.behaviour = {"answer": _answer(b'{"remote_port":18446744073709551617,"score":NaN,"x":' + deep + b"}")}
    r = _pd(sidecar, prefill, {"model": "fake-model", "prompt": "p"})
    assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "remote", r.text
    got = json.loads(decode.received[-1]["raw"])["kv_transfer_params"]
    assert got["remote_port"] == 18446744073709551617 and got["score"] != got["score"]
    assert json.dumps(got["x"]) == json.dumps(json.loads(deep))
    before = metric(sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason="bad_response")
    prefill.behaviour = {"answer": _answer(b'{"x":' + b"[" * 1010 + b"]" * 1010 + b"}")}
    r = _pd(sidecar, prefill, {"model": "fake-model", "prompt": "p"})
    assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "fallback", r.text
    assert "kv_transfer_params" not in decode.received[-1]["json"]
    assert metric(sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason="bad_response") == before + 1


@pytest.mark.parametrize("body", [
    {"model": "fake-model", "prompt": ["first", "second"]},
    {"model": "fake-model", "prompt": [[1, 2, 3], [4, 5]]},
    {"model": "fake-model", "prompt_embeds": ["AAAA", "BBBB"]},
    {"model": "fake-model", "prompt": "p", "n": 2},
    {"model": "fake-model", "prompt": "p", "best_of": "3"},
    {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 2.0},
])
def test_several_prompts_or_choices_skip_the_prefill_leg(pods, sidecar, body):
    prefill, decode = pods
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reason = "several_choices" if {"n", "best_of"} & set(body) else "several_prompts"
    before = metric(sidecar, "kvroute_sidecar_prefill_skipped_total", reason=reason)
    r = _pd(sidecar, prefill, {**body, "kv_transfer_params": {"remote_host": "169.254.169.254"}}, path)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-prefill"] == "local" and "x-kvroute-prefill-ms" not in r.headers
    assert prefill.received == []
    assert [rec["json"] for rec in decode.received] == [body]
    assert metric(sidecar, "kvroute_sidecar_prefill_skipped_total", reason=reason) == before + 1


@pytest.mark.parametrize("body", [
    {"model": "fake-model", "prompt": [1, 2, 3]},
    {"model": "fake-model", "prompt": ["only"]},
    {"model": "fake-model", "prompt": "p", "n": 1, "best_of": 1},
])
def test_one_prompt_and_one_choice_take_both_legs(pods, sidecar, body):
    prefill, decode = pods
    r = _pd(sidecar, prefill, body)
    assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "remote", r.text
    assert prefill.received[0]["json"]["prompt"] == body["prompt"]
    assert decode.received[0]["json"]["kv_transfer_params"]["remote_engine_id"] == "engine-p"


@pytest.fixture(scope="module")
def bounded_sidecar(pods):
    """A sidecar with a one-connection pool, 1 s connect and decode timeouts and prefill answers of 64 KiB at
    most."""
    _, decode = pods
    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decode.url,
            "--prefill-allowlist", '["127.0.0.1"]', "--max-connections", "1", "--connect-timeout", "1",
            "--decode-timeout", "1",
            "--prefill-timeout", "5", "--max-prefill-answer-bytes", "65536"]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prefill_answer_over_the_size_bound_falls_back(pods, bounded_sidecar, chunked):
    prefill, decode = pods
    big = _answer(b'{"remote_engine_id":"e","pad":"' + b"A" * (2 << 20) + b'"}')
    prefill.behaviour = {"answer": big, "chunked": chunked}
    before = metric(bounded_sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason="bad_response")
    r = _pd(bounded_sidecar, prefill, {"model": "fake-model", "prompt": "p"})
    assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "fallback", r.text
    assert "kv_transfer_params" not in decode.received[-1]["json"]
    assert metric(bounded_sidecar, "kvroute_sidecar_prefill_fallbacks_total", reason="bad_response") == before + 1
    if chunked:  # read 64 KiB at a time and left well before the 2 MiB's 32 writes were done
        assert prefill.wait_event("answer_cut", timeout=5), prefill.events
    prefill.behaviour = {"answer": _answer(b'{"remote_engine_id":"e","pad":"' + b"A" * 60000 + b'"}'),
                         "chunked": chunked}
    r = _pd(bounded_sidecar, prefill, {"model": "fake-model", "prompt": "p"})
    assert r.status_code == 200 and r.headers["x-kvroute-prefill"] == "remote", r.text


def test_waiting_for_a_pooled_connection_is_bounded_by_the_decode_timeout(pods, bounded_sidecar):
    """With the one pooled connection held by a stream, a direct request gets a 503 once the decode
    timeout has passed (it waited for ever). A prefill leg's wait is bounded by --prefill-timeout, as
    the whole leg is."""
    prefill, decode = pods
    decode.gate = threading.Event()  # the stream holds the pool's one connection until set
    decode.gate_ping = True          # ... sending comments, so its own 1 s decode timeout does not end it
    try:
        with httpx.stream("POST", bounded_sidecar + "/v1/chat/completions", json=chat_body(stream=True),
                          timeout=20) as held:
            lines = held.iter_lines()  # kept: a closed iterator closes the stream
            assert "tok0" in next(line for line in lines if line)
            started = time.monotonic()
            r = httpx.post(bounded_sidecar + "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                           timeout=15)
            assert r.status_code == 503 and "decode timeout (1.0s)" in r.json()["error"]["message"], r.text
            assert time.monotonic() - started < 4
            decode.gate.set()
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        decode.gate.set()
    assert metric(bounded_sidecar, "kvroute_sidecar_legs_total", leg="direct", outcome="connect_error") == 1
