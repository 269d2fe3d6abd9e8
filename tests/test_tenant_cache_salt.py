"""Tenants that never share a prefix cache: an API key's ``cache_salt`` (a secret in the router's
config). Every generation request of such a key is forwarded with a salt derived from the secret (and
from the client's own salt, if it sent one), which the client can neither choose nor learn; the
router keys the request's blocks with the same derived salt, so it credits a tenant its own earlier
turns and nothing of another tenant's identical prompt, as the pod then hits them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging

import httpx
import orjson
import pytest

from kvcommon.settings import build_settings, settings_error
from router.config import RouterSettings
from simulator.testing import consecutive_free_ports, running_sims
from tests.helpers import free_port
from tests.test_passthrough import PassPod
from tests.test_router_api import running_router

SALT_A = "tenant-alpha-SECRET-7d1e0c94b2"   # shared by two keys of tenant A
SALT_B = "tenant-bravo-SECRET-f03a6b5e18"
DOMAIN = b"kvroute/api-key-cache-salt/v1"


def derived(secret: str, client: str | None = None) -> str:
    """The salt the router forwards, computed here as documented (docs/reliability.md)."""
    data = secret.encode()
    h = hashlib.sha256(DOMAIN + len(data).to_bytes(4, "big") + data)
    h.update(b"\x00" if client is None else b"\x01" + client.encode())
    return h.hexdigest()


def keys() -> list[dict]:
    return [{"key": "sk-a", "name": "tenant-a", "cache_salt": SALT_A},
            {"key": "sk-a-ops", "name": "tenant-a-ops", "cache_salt": SALT_A, "admin": True},
            {"key": "sk-b", "name": "tenant-b", "cache_salt": SALT_B},
            {"key": "sk-b-ops", "name": "tenant-b-ops", "cache_salt": SALT_B, "admin": True},
            {"key": "sk-c", "name": "plain"},
            {"key": "sk-admin", "name": "ops", "admin": True}]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------------------------------
# the setting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["short-secret", "", "a secret with spaces in it", "x" * 1025])
def test_a_cache_salt_is_checked_when_the_settings_load_and_never_echoed(bad):
    base = {"pods": [{"id": "a", "url": "http://x", "model": "m"}]}
    good = build_settings(RouterSettings, {**base, "api_keys": keys()})
    assert [getattr(k, "cache_salt", None) for k in good.api_keys] == [SALT_A, SALT_A, SALT_B, SALT_B, None, None]
    assert SALT_A not in repr(good) and SALT_A not in repr(good.api_keys[0])
    with pytest.raises(ValueError) as refused:
        build_settings(RouterSettings, {**base, "api_keys": [{"key": "k", "cache_salt": bad}]})
    said = settings_error(refused.value)   # what kvroute serve prints
    assert "cache_salt" in said and "16 to 1024 characters" in said
    if bad:
        assert bad not in said


def test_a_keys_gate_caller_holds_the_salt_hidden_and_derives_it_as_documented():
    from router.auth import Gate

    settings = build_settings(RouterSettings, {"pods": [{"id": "a", "url": "http://x", "model": "m"}],
                                               "api_keys": keys()})
    gate = Gate(settings)
    a, a_ops, b, c = (gate.authenticate(bearer(k)) for k in ("sk-a", "sk-a-ops", "sk-b", "sk-c"))
    assert c.salt is None
    assert a.salt.derive(None) == a_ops.salt.derive(None) == derived(SALT_A)
    assert a.salt.derive("conv-1") == derived(SALT_A, "conv-1") != a.salt.derive(None)
    assert b.salt.derive(None) == derived(SALT_B) != derived(SALT_A)
    for text in (repr(a), repr(a.salt), repr(gate.callers)):
        assert SALT_A not in text and derived(SALT_A) not in text


# ---------------------------------------------------------------------------------------------
# what the pod is sent (a recording pod)
# ---------------------------------------------------------------------------------------------


def forwarded(pod: PassPod) -> dict:
    return orjson.loads(pod.seen[-1]["raw"])


@pytest.mark.e2e
async def test_the_pod_is_sent_the_keys_derived_salt_never_the_secret_or_the_clients(caplog):
    caplog.set_level(logging.DEBUG)
    pod = PassPod("pod-0", free_port())
    await pod.start()
    try:
        settings = build_settings(RouterSettings, {"pods": [{"id": "pod-0", "url": pod.url, "model": "m"}],
                                                   "port": free_port(), "health_interval_s": 0.2,
                                                   "scrape_interval_s": 0.1, "api_keys": keys()})
        async with running_router(settings) as (base, _), httpx.AsyncClient(base_url=base, timeout=10) as c:
            body = {"model": "m", "prompt": "hello there", "max_tokens": 2}
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            answers = []

            async def send(key: str, payload: dict, path: str = "/v1/completions") -> dict:
                r = await c.post(path, json=payload, headers=bearer(key))
                answers.append(r.text)
                assert r.status_code == 200, r.text
                return forwarded(pod)

            # tenant A's two keys: one derived salt, not the secret; tenant B's another
            a = (await send("sk-a", body))["cache_salt"]
            assert a == derived(SALT_A) and len(a) == 64 and a != SALT_A
            assert (await send("sk-a-ops", body))["cache_salt"] == a
            assert (await send("sk-a", chat, "/v1/chat/completions"))["cache_salt"] == a
            assert (await send("sk-b", body))["cache_salt"] == derived(SALT_B) != a
            # a client's own salt on a salted key: combined with the key's, never passed as it is
            own = await send("sk-a", {**body, "cache_salt": "conversation-7"})
            assert own["cache_salt"] == derived(SALT_A, "conversation-7") not in (a, "conversation-7")
            assert (await send("sk-b", {**body, "cache_salt": "conversation-7"}))["cache_salt"] \
                == derived(SALT_B, "conversation-7") != own["cache_salt"]
            # ... nor can a client send tenant A's derived salt to meet its cache from B's key
            assert (await send("sk-b", {**body, "cache_salt": a}))["cache_salt"] == derived(SALT_B, a) != a
            # a client salt vLLM would refuse is refused as vLLM refuses it, before any pod
            seen = len(pod.seen)
            for bad in ("", 7, "a/b", "x" * 129):
                r = await c.post("/v1/completions", json={**body, "cache_salt": bad}, headers=bearer("sk-a"))
                answers.append(r.text)
                assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
            assert len(pod.seen) == seen
            # the pooling routes take a salt too; /tokenize has none
            emb = await send("sk-a", {"model": "m", "input": "hello"}, "/v1/embeddings")
            assert emb["cache_salt"] == a
            assert "cache_salt" not in await send("sk-a", {"model": "m", "prompt": "hello"}, "/tokenize")
            # a key without a salt: the client's bytes go as they were sent, its salt (if any) with them
            for payload in (body, {**body, "cache_salt": "tenant-c-own"}):
                raw = orjson.dumps(payload)
                r = await c.post("/v1/completions", content=raw, headers={**bearer("sk-c"),
                                                                            "content-type": "application/json"})
                assert r.status_code == 200 and pod.seen[-1]["raw"] == raw
            # /debug/route with a salted admin key: computed with its salt, and says neither salt
            r = await c.post("/debug/route", json=body, headers=bearer("sk-a-ops"))
            assert r.status_code == 200
            answers.append(r.text)
            answers.append((await c.get("/metrics", headers=bearer("sk-admin"))).text)
        for text in answers + [pod_seen["raw"].decode() for pod_seen in pod.seen]:
            assert SALT_A not in text and SALT_B not in text
        for text in answers:
            assert derived(SALT_A) not in text and derived(SALT_B) not in text
        logged = "\n".join(f"{rec.getMessage()} {rec.args!r}" for rec in caplog.records)
        assert SALT_A not in logged and SALT_B not in logged
        assert derived(SALT_A) not in logged and derived(SALT_B) not in logged
    finally:
        await pod.stop()


# ---------------------------------------------------------------------------------------------
# what is credited and what the pod hits (simulated pods with KV events)
# ---------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def sims_and_router(**settings):
    """Two simulated pods (seed timing, block size 16, KV events, cached_tokens in usage) behind the
    in-process router with ``keys()``; yields an HTTP client of the router."""
    events = consecutive_free_ports(4)
    with running_sims(2, ["--enable-prompt-tokens-details", "--timing", "seed", "--kv-events-port", str(events),
                          "--block-size", "16"]) as urls:
        fleet = [{"id": f"sim-{i}", "url": url, "model": "sim-model",
                  "kv_events": [{"endpoint": f"tcp://127.0.0.1:{events + 2 * i}",
                                 "replay": f"tcp://127.0.0.1:{events + 2 * i + 1}"}]}
                 for i, url in enumerate(urls)]
        config = build_settings(RouterSettings, {"pods": fleet, "port": free_port(), "health_interval_s": 0.2,
                                                 "scrape_interval_s": 0.1, "speculative_ttl_s": 0.05,
                                                 "api_keys": keys(), **settings})
        async with running_router(config) as (base, _), httpx.AsyncClient(base_url=base, timeout=30) as c:
            yield c


async def credited(c: httpx.AsyncClient, key: str, body: dict) -> dict[str, int]:
    """What the router credits each pod of ``body``'s prompt, asked with ``key`` (its salt)."""
    r = await c.post("/debug/route", json=body, headers=bearer(key))
    assert r.status_code == 200, r.text
    return {row["pod"]: int(sum(row["cached_tokens_by_tier"].values())) for row in r.json()["pods"]}


@pytest.mark.e2e
@pytest.mark.parametrize("tokenizing", ["inline", "offloaded", "remote"])
async def test_a_tenants_follow_up_is_credited_its_own_turn_and_another_tenants_nothing(tokenizing):
    """Tenant A's first turn is cached under A's salt: A's follow-up is routed to that pod with the
    turn credited, and the pod hits exactly that; tenant B's identical follow-up is credited nothing
    anywhere and the pod hits nothing (a cold prompt), nor does an unsalted key meet A's blocks.
    The same whether the router tokenizes on the loop, off it, or asks a pod (tokenizer: remote)."""
    extra = {"inline": {}, "offloaded": {"tokenize_offload_bytes": 1, "tokenize_inline_chars": 0},
             "remote": {"tokenizer": "remote"}}[tokenizing]
    async with sims_and_router(**extra) as c:
        prefix = "Tenant A's long private context, which nobody else may probe. " * 12
        first = {"model": "sim-model", "prompt": prefix, "max_tokens": 2}
        r = await c.post("/v1/completions", json=first, headers=bearer("sk-a"))
        assert r.status_code == 200, r.text
        pod = r.headers["x-kvroute-pod"]
        follow = {"model": "sim-model", "prompt": prefix + "And a question about it?", "max_tokens": 2}
        # indexed from the pod's events (the speculative credit lasts 50 ms), read with A's admin key
        need = len(prefix.encode()) // 16 * 16 - 16
        for _ in range(200):
            got = await credited(c, "sk-a-ops", follow)
            if got[pod] >= need:
                break
            await asyncio.sleep(0.05)
        assert got[pod] >= need, got
        # another tenant, and a key with no salt, are credited nothing of it on any pod
        assert set((await credited(c, "sk-b-ops", follow)).values()) == {0}
        assert set((await credited(c, "sk-admin", follow)).values()) == {0}
        # B's follow-up: a cold prompt, wherever it lands
        r = await c.post("/v1/completions", json=follow, headers=bearer("sk-b"))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # A's follow-up: to the pod of its first turn, hitting what was credited
        before = (await credited(c, "sk-a-ops", follow))[pod]
        r = await c.post("/v1/completions", json=follow, headers=bearer("sk-a"))
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == pod
        hit = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert before == hit >= need, (before, hit)


# ---------------------------------------------------------------------------------------------
# the router's own caches keyed by prompt text: the prefix token cache and tokenizer: remote's answers
# ---------------------------------------------------------------------------------------------


def long_text(seed: int, lines: int = 80) -> str:
    from tests.test_prefix_tokens import corpus

    return " ".join(corpus(lines, seed=seed))


@pytest.mark.e2e
async def test_a_tenants_prompt_leaves_no_chunks_another_tenant_finds_in_the_routers_token_cache(tmp_path):
    """Through the app (the key's salt derived and put in the body, then the prompt tokenized on the
    event loop): a text tenant A sent is tokenized from nothing for tenant B and for a key with no
    salt, while each finds its own earlier turns; the keys of one secret share theirs; unsalted
    requests share theirs as before; a salted completion batch's other prompts are seeded too."""
    from tests.test_prefix_tokens import TOKENIZERS

    path = tmp_path / "tokenizer.json"
    TOKENIZERS["byte-level BPE (GPT-2)"].save(str(path))
    pod = PassPod("pod-0", free_port())
    await pod.start()
    try:
        settings = build_settings(RouterSettings, {"pods": [{"id": "pod-0", "url": pod.url, "model": "m"}],
                                                   "port": free_port(), "health_interval_s": 0.2,
                                                   "scrape_interval_s": 0.1, "api_keys": keys(),
                                                   "tokenizer": str(path), "tokenize_process": False,
                                                   "tokenize_offload_bytes": 10_000_000})
        async with running_router(settings) as (base, services), \
                httpx.AsyncClient(base_url=base, timeout=10) as c:
            stats = services.prefix_tokens.stats

            async def reused(key: str, prompt, **extra) -> int:
                before = stats.reused_tokens
                r = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2, **extra},
                                 headers=bearer(key))
                assert r.status_code == 200, r.text
                return stats.reused_tokens - before

            text, more, other = long_text(1), " " + long_text(2, 4), long_text(3)
            assert len(text) >= 4096
            assert await reused("sk-a", text) == 0
            assert await reused("sk-b", text) == 0   # A's chunks are not B's
            assert await reused("sk-c", text) == 0   # nor a key's without a salt
            # each finds its own: A (and A's other key, the same secret), B, and the unsalted key
            assert await reused("sk-a", text + more) > 0
            assert await reused("sk-a-ops", text + more + more) > 0
            assert await reused("sk-b", text + more) > 0
            assert await reused("sk-c", text + more) > 0
            assert await reused("sk-admin", text + more + more) > 0  # unsalted requests share, as before
            # a client's own salt on a key without one seeds its chunks too (router/prompts.py)
            assert await reused("sk-c", text + more, cache_salt="conversation-7") == 0
            assert await reused("sk-c", text + more + more, cache_salt="conversation-7") > 0
            # a salted batch's other prompts: seeded like its first
            assert await reused("sk-a", ["a short first prompt", other]) == 0
            assert await reused("sk-c", other + more) == 0
            assert await reused("sk-a", other + more) > 0
    finally:
        await pod.stop()


@pytest.mark.e2e
async def test_a_tenants_prompt_is_answered_from_the_remote_tokenizers_cache_only_for_its_own_salt():
    """``tokenizer: remote``: an answer of a pod's /tokenize is reused only by requests of the same salt
    (none: unsalted ones, as before), and the salt is never sent to the pod."""
    from types import SimpleNamespace

    from aiohttp import web

    from router.remote_prompts import RemotePrompts
    from tests.helpers import serve_routes

    seen: list[dict] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        text = body.get("prompt") or "|".join(m["content"] for m in body["messages"])
        ids = [1] * body.get("add_special_tokens", True) + [10 + b for b in text.encode()]
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 100_000})

    a, b = derived(SALT_A), derived(SALT_B)
    async with serve_routes(web.post("/tokenize", tokenize)) as port, httpx.AsyncClient() as client:
        pod = SimpleNamespace(id="pod-0", config=SimpleNamespace(id="pod-0", url=f"http://127.0.0.1:{port}",
                                                                 model="m", lora_adapters=[]))
        remote = RemotePrompts(SimpleNamespace(healthy=lambda: [pod], pods={"pod-0": pod}), lambda: None, 5.0, 64,
                               lambda reason: None)
        remote._poster = client  # type: ignore[assignment]

        async def asked(kind: str, salt: str | None, **body) -> int:
            """How many /tokenize calls the request made."""
            before = len(seen)
            got = await remote.prompt_ids(kind, {**body, **({"cache_salt": salt} if salt else {})}, "m")
            assert got.exact and got.tokens
            return len(seen) - before

        text = "Tenant A's private context. " * 20
        msgs = [{"role": "user", "content": text}]
        for kind, body in (("completion", {"prompt": text}), ("chat", {"messages": msgs}),
                           ("completion", {"prompt": text, "truncate_prompt_tokens": 50})):
            assert await asked(kind, a, **body) >= 1
            assert await asked(kind, b, **body) >= 1      # not answered from A's
            assert await asked(kind, None, **body) >= 1   # nor is an unsalted request
            assert await asked(kind, a, **body) == 0      # each from its own
            assert await asked(kind, b, **body) == 0
            assert await asked(kind, None, **body) == 0
        assert all("cache_salt" not in s and a not in str(s) and b not in str(s) for s in seen)
        tok = next(iter(remote._by_pod.values()))
        assert tok._held == sum(map(len, tok._cache.values()))  # one cache, one bound
