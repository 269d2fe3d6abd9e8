"""Bad input against a live router (a served ``kvroute serve`` in front of a simulated pod):
hypothesis-generated bodies and headers, schemathesis from the router's own OpenAPI schema, and the
hand-picked nasties (oversized, trickled, non-UTF-8, bad objectives, unknown models). Every answer
must be a success or a well-formed OpenAI-style error: never a 500, a hang or a crash."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults.harness import Sims, router

pytestmark = pytest.mark.timeout(120)

BODY_LIMIT = 64 * 1024
BODY_TIMEOUT_S = 1.5


@pytest.fixture(scope="module", params=["byte", "hf-child"])
def live(tmp_path_factory, request):
    """A router in front of one simulated pod: with the byte tokenizer, and with a Hugging Face
    tokenizer whose every prompt goes to the tokenize process (its own parsing, rendering and
    answers: a path the byte tokenizer never takes)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    sim_args = ["--timing", "seed", "--decode-s-per-token", "0.0005", "--max-model-len", "2048"]
    extra: dict = {}
    if request.param == "hf-child":
        from tests.test_prefix_tokens import TOKENIZERS

        TOKENIZERS["byte-level BPE (GPT-2)"].save(str(tmp / "tokenizer.json"))
        sim_args += ["--tokenizer", str(tmp / "tokenizer.json")]
        extra = {"tokenizer": str(tmp / "tokenizer.json"), "tokenize_offload_bytes": 1, "tokenize_inline_chars": 0}
    with Sims(1, sim_args, events=False) as sims:
        with router(tmp, sims.pods(), max_body_bytes=BODY_LIMIT, body_timeout_s=BODY_TIMEOUT_S, **extra) as r:
            with httpx.Client(base_url=r.base, timeout=15) as client:
                if extra:  # until the tokenize process is up: before, its prompts go to the threads
                    deadline = time.monotonic() + 60
                    while not re.search(r"^kvroute_tokenize_process_up 1", client.get("/metrics").text, re.M):
                        assert time.monotonic() < deadline, "the tokenize process never came up"
                        time.sleep(0.1)
                yield r, client
            assert r.proc.poll() is None, "the router died"


def check(r: httpx.Response, took_s: float) -> None:
    assert took_s < 10, f"took {took_s:.1f} s"
    assert r.status_code < 500 or r.status_code in (502, 503), (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = orjson.loads(r.content)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["code"] == r.status_code and isinstance(err["type"], str)
        assert "Traceback" not in err["message"]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        # a Responses stream ends with its response.completed event, the others with [DONE]
        assert r.text.rstrip().endswith("data: [DONE]") or "event: response.completed" in r.text[-4000:]
    else:
        orjson.loads(r.content)


def post(client: httpx.Client, path: str, **kw) -> None:
    t0 = time.monotonic()
    r = client.post(path, **kw)
    check(r, time.monotonic() - t0)


# ---------------------------------------------------------------------------------------------
# generated
# ---------------------------------------------------------------------------------------------

_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=20))
_json = st.recursive(_json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)
_prompt = st.one_of(st.text(max_size=200), st.lists(st.integers(-(2**40), 2**40), max_size=50),
                    st.lists(st.lists(st.integers(0, 300), max_size=20), max_size=3),
                    st.lists(st.text(max_size=30), max_size=3), _json)
# a media part: the router estimates such a prompt's length and keys none of it
_media = st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "video_url"]),
                                "image_url": st.fixed_dictionaries({"url": st.just("data:image/png;base64,AAAA")})})
_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]),
                                                    _json)},
                                 optional={"content": st.one_of(st.text(max_size=100), _json,
                                                                st.lists(st.one_of(st.fixed_dictionaries(
                                                                    {"type": st.just("text"),
                                                                     "text": st.text(max_size=50)}), _media),
                                                                    max_size=2))})
_common = {"model": st.one_of(st.just("sim-model"), st.text(max_size=12), _json),
           "max_tokens": st.one_of(st.integers(-5, 40), st.just(10**9), _json),
           "stream": st.one_of(st.booleans(), _json),
           "temperature": _json_scalar}
_completion = st.fixed_dictionaries({}, optional={**_common, "prompt": _prompt})
_chat = st.fixed_dictionaries({}, optional={**_common, "messages": st.one_of(st.lists(_message, max_size=3), _json)})
_item = st.one_of(_message, st.fixed_dictionaries({"type": st.sampled_from(
    ["function_call", "function_call_output", "reasoning", "message", "custom_tool_call", "nope"])},
    optional={"call_id": _json, "name": _json, "arguments": _json, "output": _json, "role": _json,
              "content": _json, "summary": _json, "status": _json}), _json)
_responses = st.fixed_dictionaries({}, optional={
    "model": _common["model"], "stream": _common["stream"], "temperature": _json_scalar,
    "input": st.one_of(st.text(max_size=100), st.lists(_item, max_size=4), _json),
    "instructions": st.one_of(st.text(max_size=40), _json), "max_output_tokens": _common["max_tokens"],
    "previous_response_id": st.one_of(st.text(max_size=60), _json), "request_id": _json,
    "tools": st.one_of(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "namespace", "x"])},
                                                      optional={"name": _json, "parameters": _json}), max_size=2),
                       _json),
    "reasoning": _json, "tool_choice": _json, "background": _json, "store": _json})
_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(str.strip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(body=_completion, slo=st.one_of(st.none(), _header_text, st.sampled_from(["abc", "-5", "0", "nan", "inf",
                                                                                 "1e309", "100"])),
       priority=st.one_of(st.none(), _header_text))
def test_generated_completion_bodies_and_headers(live, body, slo, priority):
    _, client = live
    headers = {}
    if slo is not None:
        headers["x-slo-ttft-ms"] = slo
    if priority is not None:
        headers["x-priority"] = priority
    post(client, "/v1/completions", content=json.dumps(body), headers=headers)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(body=_chat)
def test_generated_chat_bodies(live, body):
    _, client = live
    post(client, "/v1/chat/completions", content=json.dumps(body))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(body=_responses)
def test_generated_responses_bodies(live, body):
    _, client = live
    post(client, "/v1/responses", content=json.dumps(body))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(raw=st.binary(max_size=300), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                                          "/debug/route"]),
       ctype=st.one_of(st.none(), _header_text), rid=st.one_of(st.none(), _header_text))
def test_generated_raw_bytes_and_headers(live, raw, path, ctype, rid):
    _, client = live
    headers = {}
    if ctype is not None:
        headers["content-type"] = ctype
    if rid is not None:
        headers["x-request-id"] = rid
    post(client, path, content=raw, headers=headers)


def test_schemathesis_against_the_router_openapi_schema(live):
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance

    r, _ = live
    schema = schemathesis.openapi.from_url(r.base + "/openapi.json")
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schema.raw_schema["paths"])
    post_body = schema.raw_schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert post_body["content"]["application/json"]["schema"]["required"] == ["model", "prompt"]
    tested = 0
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        strategy = operation.as_strategy()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case):
            t0 = time.monotonic()
            response = case.call(timeout=15)
            assert time.monotonic() - t0 < 10
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=(not_a_server_error, status_code_conformance))
            if response.status_code >= 400 and response.request.path_url != "/metrics":
                err = response.json()["error"]
                assert err["code"] == response.status_code

        run()
        tested += 1
    assert tested >= 6
    assert sum(statuses.values()) >= 60 and 200 in statuses, statuses


# ---------------------------------------------------------------------------------------------
# hand-picked
# ---------------------------------------------------------------------------------------------


def test_the_tokenize_process_takes_the_hf_routers_prompts(live):
    """The ``hf-child`` router's prompts go to the tokenize process (else its fuzzing proves nothing
    about that path), and none fails there; the byte router has none."""
    r, client = live
    post(client, "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hello there"}]})
    text = client.get("/metrics").text
    jobs = {o: float(v) for o, v in re.findall(r'^kvroute_tokenize_process_jobs_total\{outcome="([^"]+)"\} (\S+)$',
                                               text, re.M)}
    if "tokenizer" in r.settings:
        assert jobs.get("done", 0) >= 1 and jobs.get("failed", 0) == 0, jobs
    else:
        assert jobs == {}


def test_oversized_bodies_are_refused_with_413_declared_or_streamed(live):
    _, client = live
    big = orjson.dumps({"model": "sim-model", "prompt": "x" * (BODY_LIMIT + 10)})
    r = client.post("/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413


def test_a_client_trickling_its_body_is_cut_off_with_408(live):
    r, _ = live
    sock = socket.create_connection(("127.0.0.1", r.port), timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer and time.monotonic() - t0 < 8:
            try:
                sock.sendall(b" ")  # one byte every 0.2 s: alive, never done
            except OSError:
                break
            sock.settimeout(0.2)
            try:
                answer += sock.recv(4096)
            except TimeoutError:
                pass
        took = time.monotonic() - t0
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert BODY_TIMEOUT_S - 0.2 <= took < BODY_TIMEOUT_S + 3


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan", "inf", "", "1e400"])
def test_invalid_objectives_are_400(live, value):
    _, client = live
    r = client.post("/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                    headers={"x-slo-ttft-ms": value})
    assert r.status_code == 400, (value, r.status_code, r.text)
    assert "x-slo-ttft-ms" in r.json()["error"]["message"]


def test_unknown_model_non_utf8_and_lone_surrogates(live):
    _, client = live
    r = client.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b'{"model": "sim-model", "prompt": "\xff\xfe bad"}')
    assert r.status_code == 400
    r = client.post("/v1/completions", content=b'{"model": "sim-model", "prompt": "\\ud800"}')
    assert r.status_code == 400
    r = client.post("/v1/chat/completions", content=b'{"model": "sim-model", "messages": [{"role": "user", '
                                                     b'"content": "\\udfff x"}]}')
    assert r.status_code == 400
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("rid", ["resp_x", "%00", "..%2F..%2Fmetrics", "a" * 5000, "%E2%82%AC", "resp_" + "f" * 48,
                                 "resp_" + "f" * 47 + "%0A"])
@pytest.mark.parametrize("how", ["GET", "cancel"])
def test_stored_response_routes_answer_any_id_with_an_openai_error(live, rid, how):
    """An id the router did not make for this caller, whatever its bytes, is vLLM's 404 (or the
    framework's for a path that does not match), never a 5xx; a Responses turn works meanwhile."""
    _, client = live
    t0 = time.monotonic()
    r = (client.get(f"/v1/responses/{rid}?stream=true") if how == "GET"
         else client.post(f"/v1/responses/{rid}/cancel"))
    check(r, time.monotonic() - t0)
    assert r.status_code == 404
    ok = client.post("/v1/responses", json={"model": "sim-model", "input": "hi", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_media_parts_are_routed_by_an_estimate(live):
    """A chat request with image parts: the router keys none of it and routes it on an estimate of
    its length (the simulated pod then refuses the image with vLLM's 400 for a text-only model); on
    the ``hf-child`` router through the tokenize process, whose keyless answer was once a 500."""
    _, client = live
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 2000}}
    for text in ("short", "a longer question about the weather " * 20):
        r = client.post("/v1/chat/completions", json={"model": "sim-model", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": text}, image]}]})
        check(r, 0.0)
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"], r.text
