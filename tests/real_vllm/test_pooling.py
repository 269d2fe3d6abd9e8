"""vLLM 0.32's pooling routes through ``kvroute serve`` (router/passthrough.py), in front of an
engine of the tiny model run as an embedding model (``--runner pooling --convert embed``).

* The OpenAI SDK's embeddings, and ``/pooling``, ``/score``, ``/rerank`` and Cohere's ``/v2/embed``,
  reach the engine and come back as it answered.
* A key's prompt-token charge is settled to what the engine says it ran (``usage.prompt_tokens``,
  ``meta.billed_units``): text the tiny model's small vocabulary tokenizes at about 2 characters a
  token, twice the router's estimate of 4, spends the bucket by the engine's count, so the second of
  two requests the estimate alone would admit is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from realvllm import engines as rv
from realvllm.engines import MODEL_NAME
from router.passthrough import pooled_tokens
from tests.helpers import http
from tests.real_vllm.conftest import running_router

TEXT = "the quick brown fox jumps over the lazy dog " * 20   # 880 characters: 220 tokens by the estimate


@pytest.fixture(scope="module")
def pooling_engine(real_env: rv.RealEnv, real_scratch: Path) -> Iterator[rv.Engine]:
    engine = rv.Engine(real_env, "pooling", real_scratch, core=1,
                       extra_args=["--runner", "pooling", "--convert", "embed"])
    with rv.running([engine]):
        yield engine


def test_pooling_routes_and_their_charge_through_the_router(pooling_engine, tmp_path):
    pod = {"id": "pooling", "url": pooling_engine.url, "model": MODEL_NAME}
    keys = [{"key": "k", "prompt_tokens_per_s": 0.01, "prompt_token_burst": 700}]
    with running_router(tmp_path, [pod], api_keys=keys, estimate_chars_per_token=4.0) as base:
        auth = {"authorization": "Bearer k"}
        shapes = {"/pooling": {"input": "hello world"}, "/score": {"queries": "q", "documents": ["a b"]},
                  "/rerank": {"query": "q", "documents": ["a b", "usage"]}, "/v2/embed": {"texts": ["hello world"]}}
        spent = 0
        for path, body in shapes.items():
            r = http().post(base + path, json={"model": MODEL_NAME, **body}, headers=auth, timeout=120)
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "pooling", (path, r.text)
            ran = pooled_tokens(r.content)
            assert ran is not None and 0 < ran < 20, (path, r.text)
            spent += ran
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=120)
        first = client.embeddings.create(model=MODEL_NAME, input=TEXT, encoding_format="float")
        ran = first.usage.prompt_tokens
        # the engine's count is well over the estimate, and the bucket holds less than another estimate
        assert ran > 400 and 700 - spent - ran < 220, (ran, spent)
        with pytest.raises(openai.RateLimitError, match="prompt tokens"):
            client.embeddings.create(model=MODEL_NAME, input=TEXT, encoding_format="float")
        client.close()
        assert len(first.data[0].embedding) > 0
