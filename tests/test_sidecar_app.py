"""The sidecar's ASGI app called in-process, for paths a healthy upstream never takes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import orjson
import pytest

from kvcommon.transfer import one_prefill_cannot_serve
from sidecar.config import SidecarSettings
from sidecar.legs import BadBody, is_streamed, parse_body, write_body
from sidecar.proxy import SidecarApp
from tests.helpers import ROOT


class _Exploding:
    """Stands in for the aiohttp session and fails the way a bug would."""

    def request(self, *args, **kwargs):
        raise RuntimeError("bug")

    post = request


async def _call(app: SidecarApp, path: str, body: bytes, headers: list[tuple[bytes, bytes]] | None = None):
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    never = asyncio.Event()

    async def receive():
        if messages:
            return messages.pop(0)
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers or [(b"content-type", b"application/json")]}
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


async def test_an_internal_error_is_an_openai_style_500_not_a_trace():
    app = SidecarApp(SidecarSettings(prefill_allowlist=["127.0.0.1"]))
    app.session = _Exploding()
    for headers in (None, [(b"x-prefiller-host-port", b"127.0.0.1:9")]):
        sent = await _call(app, "/v1/completions", b'{"model": "m", "prompt": "p"}', headers)
        assert sent[0]["status"] == 500
        err = orjson.loads(sent[1]["body"])["error"]
        assert err == {"message": "internal error in the sidecar", "type": "InternalServerError", "param": None,
                       "code": 500}
    assert app.metrics.in_flight._value.get() == 0


async def test_health_and_metrics_need_no_upstream():
    app = SidecarApp(SidecarSettings())
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    for path in ("/health", "/metrics"):
        await app({"type": "http", "method": "GET", "path": path, "headers": []}, None, send)
    assert sent[0]["status"] == 200 and sent[2]["status"] == 200
    assert b"kvroute_sidecar_requests_in_flight" in sent[3]["body"]


def test_help_lists_every_setting_and_bad_settings_exit_cleanly():
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "router.cli", "sidecar", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=30)

    out = run("--help")
    assert out.returncode == 0
    for name in SidecarSettings.model_fields:
        assert "--" + name.replace("_", "-") in out.stdout, name
    bad = run("--prefill-allowlist", '["10.0.0.0/33"]', "--port", "1")
    assert bad.returncode == 2 and "bad allowlist entries" in bad.stderr and "Traceback" not in bad.stderr
    bad = run("--ssl-certfile", "x.pem")
    assert bad.returncode == 2 and "go together" in bad.stderr and "Traceback" not in bad.stderr
    bad = run("--prefill-ca-file", "/nonexistent.pem", "--port", "1")
    assert bad.returncode == 2 and "prefill-ca-file" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("raw", [b'{"seed": -9223372036854775809}', b'{"seed": 18446744073709551616}',
                                 b'{"t": NaN, "u": -Infinity}', b'{"p": "\\ud800"}', b'\xef\xbb\xbf{"a": 1}',
                                 b'{"x": ' + b"[" * 300 + b"]" * 300 + b"}"])
def test_parse_and_write_keep_what_the_engine_reads(raw):
    obj, exact = parse_body(raw)
    assert json.dumps(json.loads(write_body(obj, exact))) == json.dumps(json.loads(raw))


def test_parse_takes_the_fast_path_for_ordinary_bodies_and_refuses_what_the_engine_refuses():
    obj, exact = parse_body(b'{"seed": 922337203685477580, "n": -922337203685477580, "t": 0.5, "p": "\xc3\xa9"}')
    assert not exact
    assert write_body(obj, exact) == b'{"seed":922337203685477580,"n":-922337203685477580,"t":0.5,"p":"\xc3\xa9"}'
    for raw in (b"[" * 100_000, b'{"a": 1', b"\xff\xfe\x00{"):
        with pytest.raises(BadBody, match="^request body is not valid JSON: "):
            parse_body(raw)
    deep, _ = parse_body(b"[" * 1010 + b"]" * 1010)  # orjson reads 1024 levels; neither writer goes that deep
    with pytest.raises(BadBody, match="^kv_transfer_params cannot be written as JSON: "):
        write_body(deep, False, "kv_transfer_params")


@pytest.mark.parametrize(("body", "path", "reason"), [
    ({"prompt": "p"}, "/v1/completions", None),
    ({"prompt": [1, 2, 3]}, "/v1/completions", None),
    ({"prompt": ["a"]}, "/v1/completions", None),
    ({"prompt": ["a", "b"]}, "/v1/completions", "several_prompts"),
    ({"prompt": [[1], [2]]}, "/v1/completions", "several_prompts"),
    ({"prompt_embeds": ["e1", "e2"]}, "/v1/completions", "several_prompts"),
    ({"prompt": ["a", "b"]}, "/v1/chat/completions", None),  # not a field of chat: the engine ignores it
    ({"messages": [], "n": 2}, "/v1/chat/completions", "several_choices"),
    ({"prompt": "p", "n": "2"}, "/v1/completions", "several_choices"),
    ({"prompt": "p", "best_of": 2.0}, "/v1/completions", "several_choices"),
    ({"prompt": "p", "n": 1, "best_of": None}, "/v1/completions", None),
    ({"prompt": "p", "n": True}, "/v1/completions", None),
])
def test_which_requests_one_prefill_cannot_serve(body, path, reason):
    assert one_prefill_cannot_serve(body, path) == reason


@pytest.mark.parametrize(("value", "streamed"), [
    (True, True), ("true", True), ("TRUE", True), ("yes", True), ("1", True), (1, True), (1.0, True),
    (False, False), (None, False), ("false", False), (" true ", False), (2, False), ("2", False), ([], False),
])
def test_is_streamed_reads_stream_as_vllms_request_models_do(value, streamed):
    """vLLM's request models read ``stream`` as a lax pydantic bool; the sidecar hands a streamed decode
    leg over on a client disconnect (proxy._decode_leg), so it reads the flag the same way."""
    assert is_streamed({"stream": value}) is streamed
    assert is_streamed({}) is False
