"""vLLM 0.32's token-in generation (``POST /inference/v1/generate``, with ``--enable-scale-out``) and
its render routes through ``kvroute serve`` in front of both engines (router/generate.py).

* A chat rendered by the engine's ``/v1/chat/completions/render`` (passed through) is the prompt the
  router itself renders for that chat, token for token; generating from the rendered body answers
  with that many prompt tokens.
* Follow-ups that share a long prefix of token ids go to the engine that computed it and hit its
  cache there; a stream is relayed as the engine sends it, its first event the first token.
"""

from __future__ import annotations

import os

from indexer.tokens import chat_request_ids, load_tokenizer
from realvllm.engines import MODEL_NAME, router_pod
from tests.helpers import http
from tests.real_vllm.conftest import engine_metric, running_router

PATH = "/inference/v1/generate"


def test_token_in_generation_through_the_router(agg_engines, real_env, tmp_path):
    tokenizer = load_tokenizer(str(real_env.model))
    urls = {e.name: e.url for e in agg_engines}
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=5.0) as base:
        chat = {"model": MODEL_NAME, "max_tokens": 2,
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello " * 30}]}
        rendered = http().post(base + "/v1/chat/completions/render", json=chat, timeout=120)
        assert rendered.status_code == 200, rendered.text
        ids = rendered.json()["token_ids"]
        assert ids == list(chat_request_ids(chat, tokenizer))   # the router renders what the engine does
        body = {**rendered.json(), "request_id": None}
        r = http().post(base + PATH, json={k: v for k, v in body.items() if v is not None}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)

        for n in range(3):
            head = tokenizer.encode(f"Conversation {n} {os.urandom(4).hex()}: " + " ".join(
                f"rule {i} is to answer in the voice of speaker {i * 7 + n}" for i in range(40)))
            first = http().post(base + PATH, json={"model": MODEL_NAME, "token_ids": head + [100, 200],
                                                   "sampling_params": {"max_tokens": 2}}, timeout=120)
            assert first.status_code == 200, first.text
            pod = first.headers["x-kvroute-pod"]
            before = engine_metric(urls[pod], "vllm:prefix_cache_hits_total")
            again = http().post(base + PATH, json={"model": MODEL_NAME, "token_ids": head + [300],
                                                   "sampling_params": {"max_tokens": 2}}, timeout=120)
            assert again.status_code == 200 and again.headers["x-kvroute-pod"] == pod
            hit = engine_metric(urls[pod], "vllm:prefix_cache_hits_total") - before
            assert hit >= 32 * 20, hit   # the ~900-token head's blocks, less the last
        streamed = http().post(base + PATH, json={"model": MODEL_NAME, "token_ids": head + [400], "stream": True,
                                                  "sampling_params": {"max_tokens": 3}}, timeout=120)
        events = [e for e in streamed.content.split(b"\n\n") if e]
        assert streamed.status_code == 200 and events[-1] == b"data: [DONE]", streamed.text
        assert b'"token_ids":[' in events[0]   # the first event carries the first token
