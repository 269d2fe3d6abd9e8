"""Security of the router: several API keys revoked by a config reload (SIGHUP), per-key rate limits
on requests and on prompt tokens, client headers that cannot steer routing, no secret in any log
line, TLS on the listener, least-privilege RBAC for discovery."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from router.ratelimit import TokenBucket, retry_after_s
from tests.helpers import ROOT, free_port, kvroute_process
from tests.test_router_api import completion, pods_running, running_router, settings_for

SECRET_A = "sk-alpha-3c1f9e2b7d"
SECRET_B = "sk-bravo-a81d44c0e6"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------------------------------
# token buckets (pure)
# ---------------------------------------------------------------------------------------------


def test_token_bucket_refills_at_its_rate_and_lets_an_oversized_cost_through_from_full():
    b = TokenBucket(rate=2.0, burst=2.0, now=0.0)
    assert b.take(1, 0.0) == 0.0 and b.take(1, 0.0) == 0.0
    assert b.take(1, 0.0) == pytest.approx(0.5)      # empty: half a second to the next unit
    assert b.take(1, 0.5) == 0.0                       # refilled
    big = TokenBucket(rate=100.0, burst=100.0, now=0.0)
    assert big.take(250, 0.0) == 0.0                   # larger than the bucket: let through from full ...
    assert big.take(1, 0.0) == pytest.approx(1.51)     # ... leaving a debt of 150 to wait out
    assert retry_after_s(0.01) == 1 and retry_after_s(2.2) == 3


# ---------------------------------------------------------------------------------------------
# rate limits and header steering, in process
# ---------------------------------------------------------------------------------------------


def test_a_gate_tells_what_it_charged_and_takes_the_other_processes_charges():
    """Two router processes' gates joined as the booking bus joins them: what one charges a key is
    charged in the other too, so the key gets its limits once across both, not once in each."""
    from kvcommon.errors import APIError
    from kvcommon.settings import build_settings
    from router.auth import Gate
    from router.config import RouterSettings

    clock = [100.0]
    settings = build_settings(RouterSettings, {"pods": [{"id": "p", "url": "http://127.0.0.1:1", "model": "m"}],
                                               "api_keys": [{"key": "sk-a", "name": "team-a", "requests_per_s": 1,
                                                             "request_burst": 3, "prompt_tokens_per_s": 100,
                                                             "prompt_token_burst": 1000}]})
    a, b = Gate(settings, clock=lambda: clock[0]), Gate(settings, clock=lambda: clock[0])
    sent: list = []
    a.on_spent = lambda *charge: (sent.append(charge), b.charge_foreign(*charge))
    b.on_spent = a.charge_foreign
    key = {"authorization": "Bearer sk-a"}
    for _ in range(3):
        a.admit(key)
    with pytest.raises(APIError) as refused:
        b.admit(key)  # the three requests a admitted used the key's burst in b too
    assert refused.value.status == 429
    caller = a.authenticate(key)
    charged = a.precharge(caller, 800)
    a.settle(caller, charged, 600)  # 200 given back
    assert sent[-2:] == [("team-a", 0.0, 800.0), ("team-a", 0.0, -200.0)]
    assert b.authenticate(key).prompt_tokens.level == pytest.approx(400.0)
    b.charge_foreign("nobody", 5.0, 5.0)  # a key this process does not know: skipped
    clock[0] += 1.0  # one second: one request more, in either process, not one in each
    b.admit(key)
    with pytest.raises(APIError):
        a.admit(key)


async def test_per_key_request_rate_limit_answers_429_with_retry_after_and_keys_are_separate():
    keys = [{"key": SECRET_A, "name": "alpha"}, {"key": SECRET_B, "name": "bravo", "requests_per_s": 50}]
    settings = {"api_keys": keys, "rate_limit_requests_per_s": 2, "rate_limit_request_burst": 2}
    async with pods_running(1) as pods, running_router(settings_for(pods, **settings)) as (base, services):
        async with httpx.AsyncClient(base_url=base) as c:
            codes = [(await c.post("/v1/completions", json=completion(), headers=bearer(SECRET_A))) for _ in range(3)]
            assert [r.status_code for r in codes] == [200, 200, 429]
            limited = codes[-1]
            assert int(limited.headers["retry-after"]) >= 1
            err = limited.json()["error"]
            assert err["type"] == "RateLimitError" and err["code"] == 429 and "alpha" in err["message"]
            assert SECRET_A not in limited.text
            # another key has its own bucket (and its own, higher, limit)
            others = [(await c.post("/v1/completions", json=completion(), headers=bearer(SECRET_B))).status_code
                      for _ in range(5)]
            assert others == [200] * 5
            time.sleep(0.6)  # alpha's bucket refills at 2/s
            assert (await c.post("/v1/completions", json=completion(), headers=bearer(SECRET_A))).status_code == 200
        assert services.metrics.rejections.labels("rate-limit")._value.get() == 1
        assert len(pods[0].seen) == 8  # the limited request never reached a pod


async def test_prompt_token_bucket_limits_big_prompts_per_key():
    settings = {"api_keys": [SECRET_A], "rate_limit_prompt_tokens_per_s": 100, "rate_limit_prompt_token_burst": 100}
    async with pods_running(1) as pods, running_router(settings_for(pods, **settings)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            prompt = "x" * 90  # 90 tokens with the byte tokenizer
            first = await c.post("/v1/completions", json=completion(prompt=prompt), headers=bearer(SECRET_A))
            second = await c.post("/v1/completions", json=completion(prompt=prompt), headers=bearer(SECRET_A))
            assert first.status_code == 200
            assert second.status_code == 429 and "prompt tokens" in second.json()["error"]["message"]
            assert int(second.headers["retry-after"]) >= 1
            small = await c.post("/v1/completions", json=completion(prompt="hi"), headers=bearer(SECRET_A))
            assert small.status_code == 200  # 10 tokens left: a small prompt still fits
        assert len(pods[0].seen) == 2


async def test_a_key_limited_to_some_models_uses_and_sees_only_them():
    """Any key could use every model and LoRA adapter of the fleet, another tenant's adapter too, and
    /v1/models listed them all. A key's ``models`` limits it: another model or adapter is answered as
    one that does not exist (nothing reveals that it does), before the pod or the buckets are touched."""
    from kvcommon.settings import build_settings
    from router.config import RouterSettings

    keys = [{"key": SECRET_A, "name": "alpha", "models": ["m", "alpha-sql"]}, {"key": SECRET_B, "name": "bravo"}]
    async with pods_running(1) as pods:
        fleet = [{"id": p.name, "url": p.url, "model": "m", "lora_adapters": ["alpha-sql", "bravo-chat"]}
                 for p in pods]
        settings = build_settings(RouterSettings, {"pods": fleet, "api_keys": keys, "port": free_port(),
                                                   "health_interval_s": 0.2})
        async with running_router(settings) as (base, services), httpx.AsyncClient(base_url=base) as c:
            listed = (await c.get("/v1/models", headers=bearer(SECRET_A))).json()["data"]
            assert sorted(m["id"] for m in listed) == ["alpha-sql", "m"]
            everything = (await c.get("/v1/models", headers=bearer(SECRET_B))).json()["data"]
            assert sorted(m["id"] for m in everything) == ["alpha-sql", "bravo-chat", "m"]
            for model in ("m", "alpha-sql"):
                r = await c.post("/v1/completions", json=completion(model=model), headers=bearer(SECRET_A))
                assert r.status_code == 200, r.text
            seen = len(pods[0].seen)
            other = await c.post("/v1/completions", json=completion(model="bravo-chat"), headers=bearer(SECRET_A))
            unknown = await c.post("/v1/completions", json=completion(model="nope"), headers=bearer(SECRET_A))
            assert other.status_code == unknown.status_code == 404
            assert other.json()["error"]["message"] == "The model `bravo-chat` does not exist."
            assert len(pods[0].seen) == seen  # refused before the pod
            chat = {"model": "bravo-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await c.post("/v1/chat/completions", json=chat, headers=bearer(SECRET_A))).status_code == 404
            assert (await c.post("/v1/completions", json=completion(model="bravo-chat"),
                                 headers=bearer(SECRET_B))).status_code == 200


async def test_client_headers_cannot_choose_the_pod_or_the_prefill_host():
    async with pods_running(2) as pods, running_router(settings_for(pods, policy="round-robin")) as (base, _):
        steering = {"x-kvroute-pod": "pod-1", "x-prefiller-host-port": "169.254.169.254:80",
                    "x-prefiller-url": "http://169.254.169.254/", "x-data-parallel-host-port": "10.0.0.1:1",
                    "x-encoder-hosts-ports": "10.0.0.1:2", "x-kvroute-target": "http://evil.example"}
        async with httpx.AsyncClient(base_url=base) as c:
            served = []
            for _ in range(6):
                r = await c.post("/v1/completions", json=completion(), headers=steering)
                assert r.status_code == 200
                served.append(r.headers["x-kvroute-pod"])
        assert served.count("pod-0") == 3 and served.count("pod-1") == 3  # the policy decided, not the header
        for pod in pods:
            for seen in pod.seen:
                assert not set(seen["headers"]) & set(steering), seen["headers"]


# ---------------------------------------------------------------------------------------------
# a served router: reload, logs, TLS
# ---------------------------------------------------------------------------------------------


def _post(base: str, key: str | None, **kw) -> httpx.Response:
    headers = bearer(key) if key else {}
    return httpx.post(f"{base}/v1/completions", json=completion(), headers=headers, timeout=10, **kw)


def test_sighup_reload_revokes_a_key_keeps_the_others_and_no_log_line_holds_a_key(tmp_path):
    with _one_pod() as pod_url:
        port = free_port()
        cfg = tmp_path / "router.yaml"
        base_cfg = {"port": port, "pods": [{"id": "p0", "url": pod_url, "model": "m"}], "log_level": "debug",
                    "access_log": True, "health_interval_s": 0.2}
        cfg.write_text(yaml.safe_dump({**base_cfg, "api_keys": [{"key": SECRET_A, "name": "alpha"}, SECRET_B]}))
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=f"http://127.0.0.1:{port}/ready") as proc:
            base = f"http://127.0.0.1:{port}"
            assert _post(base, SECRET_A).status_code == 200
            assert _post(base, SECRET_B).status_code == 200
            assert _post(base, "sk-wrong").status_code == 401
            assert _post(base, None).status_code == 401
            # revoke alpha
            cfg.write_text(yaml.safe_dump({**base_cfg, "api_keys": [SECRET_B]}))
            os.kill(proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 5
            while _post(base, SECRET_A).status_code != 401:
                assert time.monotonic() < deadline, "key still accepted 5 s after SIGHUP"
                time.sleep(0.05)
            assert _post(base, SECRET_B).status_code == 200
            # a broken file keeps the current keys, and its error names no value
            cfg.write_text(yaml.safe_dump({**base_cfg, "api_keys": [{"key": SECRET_A, "requests_per_s": -1}]}))
            os.kill(proc.pid, signal.SIGHUP)
            time.sleep(0.5)
            assert _post(base, SECRET_B).status_code == 200
            assert _post(base, SECRET_A).status_code == 401
            os.killpg(proc.pid, signal.SIGTERM)
            log = proc.communicate(timeout=10)[0].decode(errors="replace")
    assert "config reloaded: 1 API key(s) accepted" in log
    assert "config reload failed" in log
    assert "POST /v1/completions" in log  # the access log was on: requests were logged ...
    assert SECRET_A not in log and SECRET_B not in log and "sk-wrong" not in log  # ... but never a key


def test_tls_listener_serves_https_with_the_configured_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    with _one_pod() as pod_url:
        port = free_port()
        args = ["serve", "--port", str(port), "--pods", f'[{{"id":"p0","url":"{pod_url}","model":"m"}}]',
                "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
        with kvroute_process(args) as proc:
            base = f"https://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                assert proc.poll() is None, "router exited"
                try:
                    trusted = ssl.create_default_context(cafile=str(cert))
                    if httpx.get(f"{base}/ready", verify=trusted, timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            r = httpx.post(f"{base}/v1/completions", json=completion(),
                           verify=ssl.create_default_context(cafile=str(cert)), timeout=10)
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "p0"
            with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code >= 400:
                    raise httpx.HTTPError("refused")


def test_tls_settings_come_in_pairs():
    r = subprocess.run([os.sys.executable, "-m", "router.cli", "serve", "--ssl-certfile", "x.pem", "--pods",
                        '[{"id":"a","url":"http://127.0.0.1:1"}]'], cwd=ROOT, capture_output=True, timeout=30)
    assert r.returncode == 2 and b"ssl_certfile and ssl_keyfile go together" in r.stderr


# ---------------------------------------------------------------------------------------------
# Kubernetes: the router's Role is the least that discovery needs
# ---------------------------------------------------------------------------------------------


def test_rbac_grants_only_read_access_to_pods_in_one_namespace():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/base/rbac.yaml").read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert kinds == {"Role", "RoleBinding"}  # namespaced: no ClusterRole anywhere
    for path in Path(ROOT / "deploy/kubernetes").rglob("*.yaml"):
        for d in yaml.safe_load_all(path.read_text()):
            assert not (isinstance(d, dict) and d.get("kind") in ("ClusterRole", "ClusterRoleBinding")), path
    (role,) = [d for d in docs if d["kind"] == "Role"]
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""]
        assert rule["resources"] == ["pods"]
        assert set(rule["verbs"]) <= {"get", "list", "watch"}
        assert "resourceNames" not in rule or rule["resourceNames"]


# ---------------------------------------------------------------------------------------------


class _one_pod:
    """One simulated pod in a child process (the real vLLM-compatible surface)."""

    def __enter__(self) -> str:
        from simulator.testing import running_sims

        self._cm = running_sims(1, ["--model", "m", "--timing", "seed", "--decode-s-per-token", "0.001"])
        return self._cm.__enter__()[0]

    def __exit__(self, *exc) -> None:
        self._cm.__exit__(*exc)
