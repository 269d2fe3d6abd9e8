"""Attacks on the sidecar from a client that can reach its port (issue 13), sent as raw bytes.

The decoder behind the sidecar is a recording stand-in (``tests.test_sidecar.FakePod``) that parses
bodies with Python's json, as vLLM's FastAPI does, so each test checks what the engine would read.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.helpers import free_port, kvroute_process
from tests.rawhttp import body, error, exchange, post, status
from tests.test_sidecar import FakePod

SMUGGLED = '{"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 1, "remote_engine_id": "x"}'


@pytest.fixture(scope="module")
def decoder():
    pod = FakePod("d").start()
    yield pod
    pod.stop()


@pytest.fixture(scope="module")
def sidecar(decoder):
    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decoder.url,
            "--prefill-allowlist", '["127.0.0.1"]', "--log-level", "debug"]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health") as proc:
        yield port, proc


@pytest.fixture(scope="module")
def prefill():
    pod = FakePod("p").start()
    yield pod
    pod.stop()


@pytest.fixture(autouse=True)
def _clean(decoder, prefill):
    decoder.reset()
    prefill.reset()
    yield


def engine_view(decoder: FakePod) -> dict:
    """The last body the decoder got, read as the engine reads it."""
    assert decoder.received, "nothing reached the decoder"
    return json.loads(decoder.received[-1]["raw"])


@pytest.mark.parametrize("payload", [
    # a JSON escape in the key: the literal bytes kv_transfer_params never appear
    '{"model": "fake-model", "prompt": "p", "kv\\u005ftransfer_params": %s}' % SMUGGLED,
    '{"model": "fake-model", "prompt": "p", "\\u006b\\u0076_transfer_params": %s}' % SMUGGLED,
    # bodies orjson refuses but Python's json (the engine's) accepts
    '{"model": "fake-model", "prompt": "p", "temperature": NaN, "kv_transfer_params": %s}' % SMUGGLED,
    '{"model": "fake-model", "prompt": "\\ud800", "kv_transfer_params": %s}' % SMUGGLED,
    '{"model": "fake-model", "prompt": "p", "seed": 123456789012345678901234567890, '
    '"kv_transfer_params": %s}' % SMUGGLED,
    # duplicate keys: the last one wins in both parsers
    '{"model": "fake-model", "prompt": "p", "kv_transfer_params": {}, "kv_transfer_params": %s}' % SMUGGLED,
])
def test_client_kv_transfer_params_never_reach_the_engine_whatever_the_spelling(sidecar, decoder, payload):
    port, _ = sidecar
    resp = exchange(port, post("/v1/completions", payload.encode()))
    assert status(resp) == 200, resp
    got = engine_view(decoder)
    assert "kv_transfer_params" not in got
    assert got["model"] == "fake-model"
    if "seed" in payload:  # every other value reaches the engine exactly as the engine would have read it
        assert got["seed"] == 123456789012345678901234567890
    if "NaN" in payload:
        assert got["temperature"] != got["temperature"]


def test_utf16_body_and_bom_are_read_as_the_engine_reads_them(sidecar, decoder):
    port, _ = sidecar
    text = '{"model": "fake-model", "prompt": "p", "kv_transfer_params": %s}' % SMUGGLED
    for raw in (text.encode("utf-16"), b"\xef\xbb\xbf" + text.encode()):
        decoder.reset()
        assert status(exchange(port, post("/v1/completions", raw))) == 200
        assert "kv_transfer_params" not in engine_view(decoder)


@pytest.mark.parametrize("path", ["/v1/completions/", "//v1/completions", "/v1/./completions", "/v1/%63ompletions",
                                  "/v1/chat/completions/", "/tokenize", "/v1/completions?x=1"])
def test_every_path_that_reaches_the_engine_is_stripped_alike(sidecar, decoder, path):
    port, _ = sidecar
    payload = '{"model": "fake-model", "prompt": "p", "kv\\u005ftransfer_params": %s}' % SMUGGLED
    resp = exchange(port, post(path, payload.encode()))
    assert status(resp) == 200, resp
    assert "kv_transfer_params" not in engine_view(decoder)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/completions/", "/v1/chat/completions//", "/tokenize"])
def test_a_body_that_cannot_be_parsed_is_a_400_and_never_forwarded(sidecar, decoder, path):
    port, _ = sidecar
    for raw in (b'{"prompt": "p", "kv_transfer_params": {"remote_host": "127.0.0.1"', b"\xff\xfe\x00{",
                b"[" * 100_000):
        resp = exchange(port, post(path, raw))
        assert status(resp) == 400, resp
        assert "not valid JSON" in error(resp)["message"]
    assert decoder.received == []


def test_a_non_json_upload_off_the_generation_routes_passes_unchanged(sidecar, decoder):
    port, _ = sidecar
    raw = b"--b\r\nContent-Disposition: form-data; name=file\r\n\r\nabc\r\n--b--\r\n"
    resp = exchange(port, post("/v1/audio/transcriptions", raw, {"Content-Type": "multipart/form-data; boundary=b"}))
    assert status(resp) == 200
    assert decoder.received[-1]["raw"] == raw


def test_websocket_upgrade_is_a_clean_answer_and_its_authorization_is_never_logged(decoder):
    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decoder.url, "--log-level", "debug"]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health") as proc:
        _websocket_attempt(port, proc, decoder)


def _websocket_attempt(port, proc, decoder):
    secret = "sk-ws-secret-5f1e"
    req = (b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Authorization: Bearer " + secret.encode() + b"\r\n\r\n")
    resp = exchange(port, req, timeout=5)
    # no WebSocket here: the upgrade is ignored and the GET proxied like any other (the stand-in decoder
    # answers 200; vLLM would answer 404), never a 500 and never a 101
    assert status(resp) not in (0, 101, 500), resp
    assert all(r["method"] == "GET" and not [v for k, v in r["headers"] if k == "upgrade"] for r in decoder.received)
    # a second request shows the process is alive, then the log (debug level) must not hold the key
    assert status(exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 200
    proc.terminate()
    out = proc.stdout.read().decode(errors="replace")
    assert secret not in out


def test_asterisk_target_does_not_echo_the_decoder_url(decoder):
    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decoder.url]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health"):
        for req in (b"GET * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                    b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
            resp = exchange(port, req)
            assert status(resp) == 400, resp
            assert str(decoder.port).encode() not in resp and b"127.0.0.1" not in body(resp)
            error(resp)
    assert decoder.received == []


def test_a_60_kb_request_id_is_replaced_not_a_502(sidecar, decoder):
    port, _ = sidecar
    huge = "r" * 60_000
    resp = exchange(port, post("/v1/completions", b'{"model": "fake-model", "prompt": "p"}',
                               {"Content-Type": "application/json", "X-Request-Id": huge}))
    assert status(resp) == 200, resp[:300]
    sent = [v for k, v in decoder.received[-1]["headers"] if k == "x-request-id"]
    assert sent and len(sent[0]) <= 200


def test_idle_slow_and_http10_chunked_clients_are_bounded(decoder):
    from tests.test_abuse_router import _closed_within

    port = free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", decoder.url,
            "--header-timeout-s", "1", "--body-timeout-s", "1", "--keep-alive-s", "1"]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{port}/health"):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        started = time.monotonic()
        assert all(_closed_within(s, 6) for s in idle) and time.monotonic() - started < 6
        for s in idle:
            s.close()
        with socket.create_connection(("127.0.0.1", port)) as s:  # headers that never end
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            assert _closed_within(s, 4)
        with socket.create_connection(("127.0.0.1", port)) as s:  # a body trickled byte by byte
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            started, answer = time.monotonic(), b""
            s.settimeout(0.2)
            while time.monotonic() - started < 8 and not answer:
                try:
                    s.sendall(b" ")
                    answer = s.recv(4096)
                except TimeoutError:
                    pass
                except OSError:
                    break
            assert status(answer) == 408 and time.monotonic() - started < 4, answer
        chunked = (b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        resp = exchange(port, chunked)
        assert status(resp) == 400 and "HTTP/1.0" in error(resp)["message"]
        huge = exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 100_000 + b"\r\n\r\n")
        assert status(huge) == 431
    assert decoder.received == []


def _canonical(value) -> str:
    """``value`` written so that equal JSON values compare equal (NaN included)."""
    return json.dumps(value, sort_keys=True)


@pytest.mark.parametrize("raw", [
    pytest.param(b'{"model": "fake-model", "prompt": "p", "x": ' + b"[" * 300 + b"]" * 300 + b"}", id="300-deep"),
    pytest.param(b'{"model": "fake-model", "prompt": "p", "temperature": NaN, "top_p": Infinity}', id="nan"),
    pytest.param(b'{"model": "fake-model", "prompt": "\\ud800"}', id="lone-surrogate"),
    pytest.param(b'\xef\xbb\xbf{"model": "fake-model", "prompt": "p"}', id="bom"),
    pytest.param(b'{"model": "fake-model", "prompt": "p", "seed": 18446744073709551617}', id="int-beyond-64-bits"),
    pytest.param(b'{"model": "fake-model", "prompt": "p", "seed": -9223372036854775809}', id="19-digit-int-below-i64"),
])
def test_a_two_leg_body_reaches_both_legs_as_the_engine_reads_it(sidecar, prefill, decoder, raw):
    port, _ = sidecar
    resp = exchange(port, post("/v1/completions", raw, {"Content-Type": "application/json",
                                                        "x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}))
    assert status(resp) == 200, resp[:300]
    assert b"\r\nx-kvroute-prefill: remote\r\n" in resp
    want = json.loads(raw)
    p_got, d_got = json.loads(prefill.received[-1]["raw"]), engine_view(decoder)
    assert p_got["max_tokens"] == 1 and p_got["kv_transfer_params"]["do_remote_decode"] is True
    assert _canonical({k: p_got[k] for k in want}) == _canonical(want)
    assert d_got.pop("kv_transfer_params")["remote_engine_id"] == "engine-p"
    assert _canonical(d_got) == _canonical(want)


def test_a_two_leg_body_that_cannot_be_read_or_written_is_a_400(sidecar, prefill, decoder):
    port, _ = sidecar
    headers = {"Content-Type": "application/json", "x-prefiller-host-port": f"127.0.0.1:{prefill.port}"}
    deep = b'{"model": "fake-model", "x": ' + b"[" * 1010 + b"]" * 1010 + b"}"  # orjson reads it; no writer can
    unreadable = "request body is not valid JSON"
    for raw, says in ((deep, "request body cannot be written as JSON"), (b"[" * 100_000, unreadable),
                      (b'{"model": "fake-model", "prompt": NaN', unreadable)):
        resp = exchange(port, post("/v1/completions", raw, headers))
        assert status(resp) == 400, resp[:300]
        assert error(resp)["message"].startswith(says) and error(resp)["type"] == "BadRequestError"
    assert prefill.received == [] and decoder.received == []
