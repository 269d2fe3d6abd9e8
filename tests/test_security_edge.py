"""The router's edge beyond the proxy routes, as a client holding an ordinary key (or none) sees it:
what the non-/v1 and service endpoints answer to inputs an attacker controls (the Host header, a
trailing slash) and which requests the per-key limits count."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import free_port
from tests.test_router_api import completion, pods_running, running_router, settings_for

ALPHA = "sk-alpha-5d0e2c91"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.e2e
async def test_a_trailing_slash_is_an_openai_404_never_a_redirect_to_the_clients_host():
    # Starlette's redirect_slashes answered `POST /v1/completions/` with a 307 to
    # `http://<the client's Host header>/v1/completions`: an answer built from a client header that
    # points at a host of its choosing (a cache in front would keep it for others), and no OpenAI error
    async with pods_running(1) as pods, running_router(settings_for(pods)) as (base, _):
        async with httpx.AsyncClient(base_url=base) as c:
            for method, path in (("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"),
                                 ("POST", "/debug/route/"), ("GET", "/v1/models/"), ("GET", "/metrics/"),
                                 ("GET", "/ready/"), ("GET", "/internal/prefill-pods/")):
                r = await c.request(method, path, json=completion(), headers={"host": "evil.example"})
                assert r.status_code == 404, (path, r.status_code, r.headers.get("location"))
                assert "location" not in r.headers and "evil.example" not in r.text
                err = r.json()["error"]
                assert err["code"] == 404 and err["type"] == "NotFoundError" and path in err["message"]
        assert not pods[0].seen


@pytest.mark.e2e
async def test_listing_models_is_charged_to_the_keys_request_bucket():
    # GET /v1/models was authenticated but never charged: a key limited to 2 requests/s could send
    # any number of them (20 of 20 answered in a burst)
    settings = {"api_keys": [{"key": ALPHA, "name": "alpha"}],
                "rate_limit_requests_per_s": 2, "rate_limit_request_burst": 2}
    async with pods_running(1) as pods, running_router(settings_for(pods, **settings)) as (base, services):
        async with httpx.AsyncClient(base_url=base) as c:
            codes = [(await c.get("/v1/models", headers=bearer(ALPHA))).status_code for _ in range(5)]
            assert codes[:2] == [200, 200] and set(codes[2:]) == {429}, codes
            limited = await c.get("/v1/models", headers=bearer(ALPHA))
            err = limited.json()["error"]
            assert err["type"] == "RateLimitError" and "alpha" in err["message"] and ALPHA not in limited.text
            assert int(limited.headers["retry-after"]) >= 1
            # the same bucket as the proxy routes: the models listings used it up
            assert (await c.post("/v1/completions", json=completion(), headers=bearer(ALPHA))).status_code == 429
            # no key: still a 401, not a 429
            assert (await c.get("/v1/models")).status_code == 401
        assert not pods[0].seen
        assert services.metrics.rejections.labels("rate-limit")._value.get() == 5


@pytest.mark.e2e
async def test_the_prefill_pods_addresses_are_for_admin_keys_when_the_router_has_keys():
    # GET /internal/prefill-pods answered every caller, no key or a tenant's, with the internal
    # host:port of every prefill pod; with API keys it is an admin route now (the sidecars send one)
    from kvcommon.settings import build_settings
    from router.config import RouterSettings

    admin = "sk-ops-e61f0b37"
    keys = [{"key": admin, "name": "ops", "admin": True}, {"key": ALPHA, "name": "alpha"}]
    async with pods_running(1) as pods:
        fleet = [{"id": "d0", "url": pods[0].url, "model": "m"},
                 {"id": "p0", "url": "http://10.9.8.7:8100", "model": "m", "role": "prefill"}]
        for api_keys in (keys, []):
            settings = build_settings(RouterSettings, {"pods": fleet, "port": free_port(), "api_keys": api_keys})
            async with running_router(settings) as (base, _), httpx.AsyncClient(base_url=base) as c:
                answers = {who: await c.get("/internal/prefill-pods", headers=headers) for who, headers in
                           (("none", {}), ("tenant", bearer(ALPHA)), ("admin", bearer(admin)))}
                if not api_keys:  # an open router trusts whoever reaches it: unchanged
                    assert {who: r.json() for who, r in answers.items()} == dict.fromkeys(answers, ["10.9.8.7:8100"])
                    continue
                assert answers["admin"].status_code == 200 and answers["admin"].json() == ["10.9.8.7:8100"]
                for who, code, kind in (("none", 401, "AuthenticationError"), ("tenant", 403, "PermissionDeniedError")):
                    r = answers[who]
                    assert r.status_code == code and r.json()["error"]["type"] == kind, (who, r.text)
                    assert "10.9.8.7" not in r.text and ALPHA not in r.text
                assert "www-authenticate" in answers["none"].headers
                assert "admin" in answers["tenant"].json()["error"]["message"]
