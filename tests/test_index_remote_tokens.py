"""Remote tokenization through a pod's /tokenize over real HTTP, with the bounded cache."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web

from indexer.tokens import ByteTokenizer, RemoteTokenizeError, RemoteTokenizer
from tests.helpers import serve_routes


async def test_remote_tokenize_prompt_and_chat_with_cache():
    calls = []
    tok = ByteTokenizer()

    async def tokenize(request):
        body = await request.json()
        calls.append(body)
        if body.get("prompt") == "boom":
            return web.json_response({"error": "bad"}, status=400)
        text = body["prompt"] if "prompt" in body else tok.apply_chat_template(body["messages"])
        ids = tok.encode(text)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    async with serve_routes(web.post("/tokenize", tokenize)) as port, httpx.AsyncClient() as client:
        rt = RemoteTokenizer(f"http://127.0.0.1:{port}/", "m", client, cache_size=2)
        assert await rt.encode("hello") == list(b"hello")
        assert await rt.encode("hello") == list(b"hello")
        assert len(calls) == 1 and rt.hits == 1
        msgs = [{"role": "user", "content": "hi"}]
        assert await rt.encode_chat(msgs) == tok.encode(tok.apply_chat_template(msgs))
        assert calls[-1]["messages"] == msgs and calls[-1]["model"] == "m"
        await rt.encode("a")
        await rt.encode("b")  # evicts the oldest entries beyond 2
        assert len(rt._cache) == 2
        await rt.encode("hello")
        assert len(calls) == 5
        with pytest.raises(RemoteTokenizeError):
            await rt.encode("boom")


async def test_remote_tokenize_cache_keys_by_digest_and_is_bounded_by_tokens_held():
    """An entry costs its ids and a 16-byte digest of the body, not the body; past ``max_tokens`` ids
    held the oldest go, an answer of more is not kept, and one body asked twice at once counts once."""
    calls = []

    async def tokenize(request):
        body = await request.json()
        calls.append(body["prompt"])
        await asyncio.sleep(0.05)  # so that two asks of one body overlap
        return web.json_response({"tokens": list(body["prompt"].encode())})

    async with serve_routes(web.post("/tokenize", tokenize)) as port, httpx.AsyncClient() as client:
        rt = RemoteTokenizer(f"http://127.0.0.1:{port}", "m", client, cache_size=100, max_tokens=1000)
        big = "x" * 100_000
        assert await rt.encode(big[:900]) == [ord("x")] * 900
        assert all(len(key) == 16 for key in rt._cache) and rt._held == 900
        prompts = [f"{i:03d}" + "y" * 297 for i in range(5)]  # 300 ids each
        for p in prompts:
            assert len(await rt.encode(p)) == 300
        assert rt._held == 900 and len(rt._cache) == 3  # the 900 first, then the oldest of the rest
        assert await rt.encode(prompts[-1]) == list(prompts[-1].encode()) and rt.hits == 1
        await rt.encode(prompts[0])  # let go: asked again
        assert calls.count(prompts[0]) == 2
        assert len(await rt.encode(big)) == 100_000  # more than the bound: answered, not kept
        assert rt._held <= 1000 and all(len(ids) == 300 for ids in rt._cache.values())
        twice = "z" * 200
        await asyncio.gather(rt.encode(twice), rt.encode(twice))
        assert calls.count(twice) == 2 and rt._held == sum(len(ids) for ids in rt._cache.values()) <= 1000
