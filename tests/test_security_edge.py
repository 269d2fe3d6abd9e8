"""The router's edge beyond the proxy routes, as a client holding an ordinary key (or none) sees it:
what the non-/v1 and service endpoints answer to inputs an attacker controls (the Host header, a
trailing slash) and which requests the per-key limits count."""

from __future__ import annotations

import httpx
import pytest

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
