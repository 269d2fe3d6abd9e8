"""vLLM's /tokenize and /detokenize through the router (router/passthrough.py) to real engines: each
answer equals the one the engine that served it gives when asked directly."""

from __future__ import annotations

from realvllm.engines import MODEL_NAME, router_pod
from tests.helpers import http
from tests.real_vllm.conftest import running_router

TEXT = "the router sends each request to the pod whose prefix cache already holds most of its prompt"


def test_tokenize_and_detokenize_through_the_router_answer_as_the_engine_does(agg_engines, real_env, tmp_path):
    urls = {e.name: e.url for e in agg_engines}
    bodies = [
        ("/tokenize", {"model": MODEL_NAME, "prompt": TEXT}),
        ("/tokenize", {"model": MODEL_NAME, "messages": [{"role": "user", "content": TEXT}],
                       "add_generation_prompt": True}),
        ("/tokenize", {"prompt": TEXT, "add_special_tokens": False}),  # no model: the fleet's one
        ("/detokenize", {"model": MODEL_NAME, "tokens": [0, 11, 402, 77, 1200, 5, 9, 2800, 64]}),
    ]
    with running_router(tmp_path, [router_pod(e) for e in agg_engines], tokenizer=str(real_env.tokenizer)) as base:
        for path, body in bodies:
            routed = http().post(base + path, json=body)
            assert routed.status_code == 200, (path, routed.text)
            pod = routed.headers["x-kvroute-pod"]
            direct = http().post(urls[pod] + path, json=body)
            assert direct.status_code == 200, direct.text
            assert routed.json() == direct.json(), (path, body)
            assert routed.headers["content-type"] == direct.headers["content-type"]
        # a round trip: the ids /tokenize gave come back as the text through /detokenize
        ids = http().post(base + "/tokenize", json={"model": MODEL_NAME, "prompt": TEXT,
                                                    "add_special_tokens": False}).json()["tokens"]
        back = http().post(base + "/detokenize", json={"model": MODEL_NAME, "tokens": ids})
        assert back.status_code == 200 and back.json()["prompt"].strip() == TEXT
        # an unknown model is the router's 404, not a pod's answer
        r = http().post(base + "/tokenize", json={"model": "nope", "prompt": TEXT})
        assert r.status_code == 404 and "x-kvroute-pod" not in r.headers
