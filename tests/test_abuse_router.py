"""Attacks on a served router from clients that hold an ordinary API key, or none (issue 13).

Each test starts ``kvroute serve`` in front of one simulated pod and talks to it as an attacker
would, with raw sockets where the bytes matter: a cache oracle through introspection, priority and
objective headers that skip early rejection, batched prompts counted as one, big bodies charged
after the tokenizer ran, slow and idle connections, secrets that reach a log.
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager

import httpx
import pytest
import yaml

from router.costs import estimate_prompt_tokens
from simulator.testing import running_sims
from tests.helpers import free_port, kvroute_process
from tests.rawhttp import error, exchange, post, read_response, status

ADMIN, ALPHA, PRIO = "sk-admin-7e0c1d", "sk-alpha-91b2f4", "sk-prio-3a6d05"
KEYS = [{"key": ADMIN, "name": "ops", "admin": True},
        {"key": ALPHA, "name": "alpha"},
        {"key": PRIO, "name": "prio", "allow_priority": True, "allow_objective": True}]


@pytest.fixture(scope="module")
def pod():
    with running_sims(1) as urls:
        yield urls[0]


@contextmanager
def served(pod_url: str, tmp_path, **cfg):
    port = free_port()
    path = tmp_path / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump({"port": port, "pods": [{"id": "p0", "url": pod_url, "model": "sim-model"}],
                                    "health_interval_s": 0.2, **cfg}))
    with kvroute_process(["serve", "--config", str(path)], ready_url=f"http://127.0.0.1:{port}/ready") as proc:
        yield port, proc


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {key}", **extra}


def completion(prompt="hello", **extra) -> bytes:
    return json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 2, **extra}).encode()


def log_of(proc) -> str:
    proc.terminate()
    return proc.communicate(timeout=15)[0].decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# introspection is for admins; metrics and readiness tell a tenant nothing
# ---------------------------------------------------------------------------------------------


def test_debug_route_and_metrics_need_an_admin_key(pod, tmp_path):
    with served(pod, tmp_path, api_keys=KEYS) as (port, _):
        body = completion("a guessed price and date " * 20)
        for key, want in ((ALPHA, 403), (PRIO, 403), (ADMIN, 200)):
            resp = exchange(port, post("/debug/route", body, auth(key)))
            assert status(resp) == want, resp[:300]
        assert status(exchange(port, post("/debug/route", body))) == 401
        denied = exchange(port, post("/debug/route", body, auth(ALPHA)))
        assert "admin" in error(denied)["message"] and b"cached_tokens" not in denied
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/metrics").status_code == 401
        assert httpx.get(base + "/metrics", headers=auth(ALPHA)).status_code == 403
        scraped = httpx.get(base + "/metrics", headers=auth(ADMIN))
        assert scraped.status_code == 200 and "kvroute_estimated_cached_tokens" in scraped.text
        assert httpx.get(base + "/ready").json() == {"ready": True}


# ---------------------------------------------------------------------------------------------
# priority and objective headers belong to the key
# ---------------------------------------------------------------------------------------------


def test_priority_and_objective_headers_count_only_for_keys_allowed_them(pod, tmp_path):
    # an objective no prediction can meet: every request is rejected unless something skips admission
    with served(pod, tmp_path, api_keys=KEYS, ttft_objective_ms=0.001) as (port, _):
        def code(key: str, **headers: str) -> int:
            return status(exchange(port, post("/v1/completions", completion(), auth(key, **headers))))

        assert code(ALPHA) == 429
        for value in ("critical", "HIGH ", "high"):
            assert code(ALPHA, **{"x-priority": value}) == 429      # ignored for an ordinary key
        assert code(ALPHA, **{"x-slo-ttft-ms": "100000"}) == 429    # may not loosen its objective
        resp = exchange(port, post("/v1/completions", completion(), auth(ALPHA, **{"x-slo-ttft-ms": "1e300"})))
        assert status(resp) == 400 and "x-slo-ttft-ms" in error(resp)["message"]  # bounded for everyone
        assert code(PRIO, **{"x-priority": "critical"}) == 200      # honoured for the key allowed it
        assert code(PRIO, **{"x-slo-ttft-ms": "100000"}) == 200
        # a tenant's 429 carries no predicted figure: the prediction falls by what the pods hold of
        # the prompt, so the figure told a tenant whether another's prompt was cached, no pod asked
        tenant = error(exchange(port, post("/v1/completions", completion(), auth(ALPHA))))["message"]
        assert "predicted" in tenant and " ms" not in tenant and not any(c.isdigit() for c in tenant)
        admin = error(exchange(port, post("/v1/completions", completion(), auth(ADMIN))))["message"]
        assert "best predicted time to first token is" in admin and " ms objective" in admin


# ---------------------------------------------------------------------------------------------
# every prompt of a batch counts; limits are charged before the tokenizer runs
# ---------------------------------------------------------------------------------------------


def test_a_batch_counts_every_prompt_for_limits_and_prediction(pod, tmp_path):
    keys = [*KEYS, {"key": "sk-small-1", "name": "small", "prompt_tokens_per_s": 1000, "prompt_token_burst": 1000}]
    with served(pod, tmp_path, api_keys=keys) as (port, _):
        batch = {"model": "sim-model", "prompt": ["a", "x" * 300_000], "max_tokens": 1}
        explained = json.loads(exchange(port, post("/debug/route", json.dumps(batch).encode(), auth(ADMIN)))
                               .partition(b"\r\n\r\n")[2])
        assert explained["prompt_tokens"] >= 300_001
        ids = {"model": "sim-model", "prompt": [[1, 2], list(range(5000))], "max_tokens": 1}
        explained = json.loads(exchange(port, post("/debug/route", json.dumps(ids).encode(), auth(ADMIN)))
                               .partition(b"\r\n\r\n")[2])
        assert explained["prompt_tokens"] == 5002
        small = {"model": "sim-model", "prompt": ["a", "x" * 5000], "max_tokens": 1}
        first = exchange(port, post("/v1/completions", json.dumps(small).encode(), auth("sk-small-1")))
        # from a full bucket, into debt (routed: the simulated pod itself answers a batch with a 400)
        assert status(first) in (200, 400) and b"rate limit" not in first
        second = exchange(port, post("/v1/completions", completion("a"), auth("sk-small-1")))
        assert status(second) == 429 and "prompt tokens" in error(second)["message"]


def _routing_count(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=auth(ADMIN)).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvroute_routing_seconds_count"))


@pytest.mark.parametrize("message", [
    {"role": "user", "content": [{"type": "text", "text": "x" * 40_000}]},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "x" * 40_000}]},   # counted 0 before
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "x" * 40_000}]},  # counted 0 before
    {"role": "assistant", "content": "", "reasoning_content": "x" * 40_000},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "x" * 40_000}}]},
], ids=["text", "refusal", "thinking", "reasoning", "tool_calls"])
def test_every_text_the_chat_template_renders_counts_in_the_estimate(message):
    # the estimate is charged before tokenizing; text it did not count reached the tokenizer and the pod
    # whatever the caller's bucket held
    body = {"model": "m", "messages": [message]}
    assert estimate_prompt_tokens("chat", body, 4.0) >= 10_000
    tools = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
             "tools": [{"type": "function", "function": {"name": "f", "description": "x" * 40_000}}]}
    assert estimate_prompt_tokens("chat", tools, 4.0) >= 10_000


def test_prompt_tokens_are_charged_before_the_tokenizer_runs(pod, tmp_path):
    keys = [*KEYS, {"key": "sk-flood-1", "name": "flood", "prompt_tokens_per_s": 10_000, "prompt_token_burst": 10_000}]
    with served(pod, tmp_path, api_keys=keys) as (port, _):
        assert status(exchange(port, post("/v1/completions", completion("x" * 6000), auth("sk-flood-1")))) == 200
        before = _routing_count(port)
        # 4,000 tokens left: a 2 MB prompt is refused on its estimate, before any tokenizing or routing
        big = exchange(port, post("/v1/completions", completion("x" * 2_000_000), auth("sk-flood-1")))
        assert status(big) == 429 and "prompt tokens" in error(big)["message"]
        assert _routing_count(port) == before
        # in debt, a caller is refused before its body is even read: headers only, no body sent
        time.sleep(1.1)  # full again; a prompt bigger than the bucket goes through from full, into debt
        through = exchange(port, post("/v1/completions", completion("x" * 50_000), auth("sk-flood-1")))
        assert status(through) != 429  # routed (the simulated pod refuses a prompt over its context: 400)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer sk-flood-1\r\nContent-Length: 5000000\r\n\r\n")
            started = time.monotonic()
            resp = read_response(s, 5)
        assert status(resp) == 429 and time.monotonic() - started < 2


# ---------------------------------------------------------------------------------------------
# slow and idle clients
# ---------------------------------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _closed_count(port: int, reason: str, key: str | None = ADMIN) -> float:
    headers = auth(key) if key else {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f'kvroute_connections_closed_total{{reason="{reason}"}}'))


def _trickled_until_closed(s: socket.socket, data: bytes) -> bool:
    """Send ``data`` a byte every 50 ms for at most 3 s; whether the router closed the connection
    (by then, or within 3 s more)."""
    started = time.monotonic()
    for b in data:
        try:
            s.sendall(bytes([b]))
        except OSError:
            return True
        time.sleep(0.05)
        if time.monotonic() - started > 3:
            break
    return _closed_within(s, 3)


def test_idle_slow_header_and_slow_body_connections_are_closed(pod, tmp_path):
    with served(pod, tmp_path, api_keys=KEYS, header_timeout_s=1, body_timeout_s=1, keep_alive_s=1) as (port, _):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        started = time.monotonic()
        assert all(_closed_within(s, 6) for s in idle)          # never sent a byte: closed
        assert time.monotonic() - started < 6
        for s in idle:
            s.close()
        # headers trickled one byte at a time
        with socket.create_connection(("127.0.0.1", port)) as s:
            assert _trickled_until_closed(s, b"POST /debug/route HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200)
        # the same on a kept-alive connection, after a first request: the bound starts again
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status(read_response(s, 3)) == 200
            assert _trickled_until_closed(s, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200)
        # a body trickled to /debug/route (admin) and to a route that never reads it
        for path, key in (("/debug/route", ADMIN), ("/health", ADMIN)):
            with socket.create_connection(("127.0.0.1", port)) as s:
                method = "POST" if path != "/health" else "GET"
                s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{".encode())
                started = time.monotonic()
                answer = b""
                s.settimeout(0.2)
                while time.monotonic() - started < 8:
                    try:
                        s.sendall(b" ")
                    except OSError:
                        break
                    try:
                        got = s.recv(4096)
                        if not got:
                            break
                        answer += got
                    except TimeoutError:
                        pass
                    except ConnectionResetError:
                        break
                assert time.monotonic() - started < 6, path
                if path == "/debug/route":
                    assert status(answer) == 408, answer
        # a kept-alive connection that goes idle after a response
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status(read_response(s, 3)) == 200
            assert _closed_within(s, 4)
        # each close is counted by its reason (the idle keep-alive close is uvicorn's, not counted)
        assert _closed_count(port, "header_timeout") >= 32   # 30 idle + the two trickled heads
        assert _closed_count(port, "body_timeout") >= 1      # the body /health never read
        assert _closed_count(port, "header_too_large") == 0


def test_oversized_headers_and_http10_chunked_bodies_are_refused(pod, tmp_path):
    with served(pod, tmp_path) as (port, _):
        huge = exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 100_000 + b"\r\n\r\n")
        assert status(huge) == 431
        error(huge)
        chunked = (b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
        body = completion()
        chunked += b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        resp = exchange(port, chunked)
        assert status(resp) == 400 and "HTTP/1.0" in error(resp)["message"]
        assert _closed_count(port, "header_too_large", key=None) == 1
        assert _closed_count(port, "bad_framing", key=None) == 1
        # what httptools cannot parse at all gets the same JSON error (it was uvicorn's plain text,
        # with a warning logged for every such request)
        for head in (b"X-Foo: a\x00b\r\nContent-Length: 2\r\n", b"Content-Length: 2\r\nContent-Length: 3\r\n",
                     b"Content-Length: -1\r\n", b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n"):
            resp = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
            assert status(resp) == 400 and b"application/json" in resp.split(b"\r\n\r\n")[0], resp
            assert "Invalid HTTP request" in error(resp)["message"]
        assert _closed_count(port, "bad_framing", key=None) == 5
        # a 60 KB request id is replaced, not passed on (and never a 502)
        resp = exchange(port, post("/v1/completions", completion(),
                                   {"Content-Type": "application/json", "X-Request-Id": "r" * 60_000}))
        assert status(resp) == 200
        rid = [line for line in resp.split(b"\r\n\r\n")[0].split(b"\r\n") if line.lower().startswith(b"x-request-id")]
        assert rid and len(rid[0]) < 300


# ---------------------------------------------------------------------------------------------
# secrets and tracebacks in logs
# ---------------------------------------------------------------------------------------------


def test_no_secret_and_no_traceback_in_the_log_at_debug_level(pod, tmp_path):
    with served(pod, tmp_path, api_keys=KEYS, log_level="debug", access_log=True) as (port, proc):
        # a key in the query string (some clients do that) and in a WebSocket upgrade
        exchange(port, post(f"/v1/completions?api_key={ALPHA}&x=1", completion(), auth(ALPHA)))
        ws = (f"GET /v1/realtime?token={PRIO} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
              f"Authorization: Bearer {ADMIN}\r\n\r\n").encode()
        answer = exchange(port, ws, timeout=5)
        assert status(answer) not in (0, 101, 500), answer
        # a client that leaves mid-body on /debug/route
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /debug/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ADMIN.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"prompt\": \"")
            time.sleep(0.3)
        time.sleep(0.5)
        assert status(exchange(port, post("/v1/completions", completion(), auth(ALPHA)))) == 200
        log = log_of(proc)
    assert "POST /v1/completions" in log             # the access log was on
    for secret in (ADMIN, ALPHA, PRIO):
        assert secret not in log
    assert "Traceback" not in log and " ERROR " not in log
