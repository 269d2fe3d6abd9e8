"""Remote tokenization through a pod's /tokenize over real HTTP, with the bounded cache."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from indexer.tokens import ByteTokenizer, RemoteTokenizeError, RemoteTokenizer
from tests.helpers import free_port


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

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with httpx.AsyncClient() as client:
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
    finally:
        await runner.cleanup()
