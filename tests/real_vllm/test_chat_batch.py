"""vLLM 0.32's batch of chat conversations (``POST /v1/chat/completions/batch``) against real engines
(router/chat_batch.py).

* What the router assumes of the route holds on the engine: a batch's prompt tokens are the sum of
  its conversations' as chat requests without tools (tools in a batch are not rendered), the
  conversation the router renders is its first (the router's tokenizer gives the same count), and
  ``stream: true`` is answered whole.
* Through ``kvroute serve`` in front of both engines: batches whose first conversations share a long
  system prompt go to the engine that computed it and hit its cache there, with one choice per
  conversation; the other conversations count at an estimate of their length.
"""

from __future__ import annotations

import os

from indexer.tokens import chat_request_ids, load_tokenizer
from realvllm.engines import MODEL_NAME, router_pod
from router.chat_batch import BatchTurn
from tests.helpers import http
from tests.real_vllm.conftest import engine_metric, running_router

PATH = "/v1/chat/completions/batch"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


def _conversations(tag: str) -> list[list[dict]]:
    return [[{"role": "system", "content": f"Batch {tag}: be brief."}, {"role": "user", "content": "hello " * 40}],
            [{"role": "user", "content": "what is two plus two? " * 12}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]]


def test_a_batch_is_its_conversations_rendered_without_tools(agg_engines, real_env):
    tokenizer = load_tokenizer(str(real_env.model))
    engine = agg_engines[0]
    conversations = _conversations(os.urandom(4).hex())
    alone = []
    for c in conversations:
        r = http().post(engine.url + "/v1/chat/completions",
                        json={"model": MODEL_NAME, "messages": c, "max_tokens": 1}, timeout=120)
        assert r.status_code == 200, r.text
        alone.append(r.json()["usage"]["prompt_tokens"])
    body = {"model": MODEL_NAME, "messages": conversations, "max_tokens": 2, "tools": TOOLS, "stream": True}
    r = http().post(engine.url + PATH, json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["prompt_tokens"] == sum(alone), (answer["usage"], alone)
    # the router's rendering of the batch is its first conversation's, as a chat request without tools
    view = BatchTurn(body, b"", False, 4.0).view
    assert "tools" not in view and len(chat_request_ids(view, tokenizer)) == alone[0]
    with_tools = http().post(engine.url + "/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": conversations[0], "max_tokens": 1, "tools": TOOLS, "tool_choice": "none"},
                            timeout=120)   # the engines have no tool parser: "none" is the one choice they take
    assert with_tools.status_code == 200 and with_tools.json()["usage"]["prompt_tokens"] > alone[0]


def test_batches_through_the_router(agg_engines, real_env, tmp_path):
    urls = {e.name: e.url for e in agg_engines}
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=5.0) as base:
        for n in range(3):
            system = f"Conversation {n} {os.urandom(4).hex()}: " + " ".join(
                f"rule {i} is to answer in the voice of speaker {i * 7 + n}" for i in range(40))
            first = http().post(base + PATH, json={"model": MODEL_NAME, "max_tokens": 2, "messages": [
                [{"role": "system", "content": system}, {"role": "user", "content": "first question"}],
                [{"role": "user", "content": f"an unrelated question {n}"}]]}, timeout=120)
            assert first.status_code == 200, first.text
            assert len(first.json()["choices"]) == 2
            pod = first.headers["x-kvroute-pod"]
            before = engine_metric(urls[pod], "vllm:prefix_cache_hits_total")
            again = http().post(base + PATH, json={"model": MODEL_NAME, "max_tokens": 2, "messages": [
                [{"role": "system", "content": system}, {"role": "user", "content": "second question"}],
                [{"role": "user", "content": f"another question {n}"}],
                [{"role": "user", "content": "and a third"}]]}, timeout=120)
            assert again.status_code == 200 and again.headers["x-kvroute-pod"] == pod
            assert len(again.json()["choices"]) == 3
            hit = engine_metric(urls[pod], "vllm:prefix_cache_hits_total") - before
            assert hit >= 32 * 20, hit   # the ~900-token system prompt's blocks, less the last
