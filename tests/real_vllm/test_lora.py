"""A LoRA adapter on a real engine (``--enable-lora --lora-modules sql=<path>``, the adapter the
tiny-model script writes): the engine announces the adapter's blocks with its name, hashed with the
adapter in every block's extra keys exactly as the simulator hashes them; the router sends the
adapter's requests to that engine only and credits an adapter's follow-up exactly what the engine
then hits, and none of the base model's copy of the same text; an adapter loaded at run time
(``/v1/load_lora_adapter``) is routed to once the engine lists it, and no longer once unloaded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from realvllm import engines as rv
from realvllm.engines import BLOCK_SIZE, MODEL_NAME, router_pod
from simulator.hashing import BlockHasher, external
from tests.helpers import http
from tests.real_vllm.conftest import cached_tokens, engine_metric, running_router, wait_for, wait_indexed
from tests.real_vllm.test_hashes import stored_events

ADAPTER = "sql"
WORDS = "select from where group order having join inner outer limit offset union count distinct".split()


@pytest.fixture(scope="module")
def lora_engine(real_env: rv.RealEnv, real_scratch) -> Iterator[rv.Engine]:
    """One engine (core 0) serving the tiny model and its adapter ``sql``, adapters loadable at run time."""
    path = real_env.model / f"lora-{ADAPTER}"
    assert (path / "adapter_config.json").is_file(), f"no adapter at {path}: run make real-vllm"
    engine = rv.Engine(real_env, "lora", real_scratch, core=0, extra_args=[
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"{ADAPTER}={path}"],
        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})   # /v1/load_lora_adapter and unload
    with rv.running([engine]):
        yield engine


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * (seed + 2)) % len(WORDS)] for i in range(words))


def test_the_engine_announces_an_adapters_blocks_as_the_simulator_hashes_them(lora_engine, real_env):
    path = str(real_env.model / f"lora-{ADAPTER}")
    listed = {m["id"]: (m["root"], m["parent"]) for m in http().get(lora_engine.url + "/v1/models").json()["data"]}
    assert listed[ADAPTER] == (path, MODEL_NAME)
    prompt = [100 + (i * 37) % 1800 for i in range(3 * BLOCK_SIZE + 3)]
    events = stored_events(lora_engine, {"model": ADAPTER, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                         "cache_salt": "t"})
    assert events[0].lora_name == ADAPTER and events[0].lora_id == 1
    assert [list(k) for k in (events[0].extra_keys or [])[:2]] == [[ADAPTER, "t"], [ADAPTER]]
    hasher = BlockHasher("sha256", lora_engine.environment()["PYTHONHASHSEED"])
    mine = hasher.chain(None, prompt, BLOCK_SIZE, first_keys=(("cache_salt", "t"),),
                        every_keys=(("lora", ADAPTER, path),))
    assert [h for e in events for h in e.block_hashes][:3] == [external(d) for d in mine]


def test_an_adapters_follow_up_is_credited_as_the_engine_hits_it(lora_engine, agg_engines, real_env, tmp_path):
    pods = [router_pod(lora_engine, lora_adapters=[ADAPTER]), router_pod(agg_engines[1])]
    with running_router(tmp_path, pods, tokenizer=str(real_env.tokenizer), speculative_ttl_s=0.05) as base:
        models = {m["id"]: m["parent"] for m in http().get(base + "/v1/models").json()["data"]}
        assert models == {MODEL_NAME: None, ADAPTER: MODEL_NAME}
        prefix = text(3, 600)
        follow = prefix + " " + text(4, 200)

        # the base model's copy of the prefix on the adapter's engine counts nothing for the adapter
        r = http().post(lora_engine.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prefix,
                                                                   "max_tokens": 2})
        assert r.status_code == 200, r.text
        wait_for(lambda: cached_tokens(base, {"model": MODEL_NAME, "prompt": follow}, "lora") > 0, 15,
                 "the base model's blocks indexed")
        adapter_follow = {"model": ADAPTER, "prompt": follow, "max_tokens": 2}
        assert [p["pod"] for p in http().post(base + "/debug/route", json=adapter_follow).json()["pods"]] == ["lora"]
        assert cached_tokens(base, adapter_follow, "lora") == 0

        r = http().post(base + "/v1/completions", json={"model": ADAPTER, "prompt": prefix, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "lora", r.text
        predicted = wait_indexed(base, adapter_follow, "lora", r.json()["usage"]["prompt_tokens"])
        before = engine_metric(lora_engine.url, "vllm:prefix_cache_hits_total")
        r = http().post(base + "/v1/completions", json=adapter_follow)
        assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "lora", r.text
        observed = engine_metric(lora_engine.url, "vllm:prefix_cache_hits_total") - before
        print(f"adapter follow-up: {r.json()['usage']['prompt_tokens']} prompt tokens, router credited "
              f"{predicted}, engine hit {observed}")
        assert predicted == observed > 0


def test_an_adapter_loaded_at_run_time_is_routed_to_and_one_unloaded_is_not(lora_engine, real_env, tmp_path):
    """The router is told of no adapter: it reads them from the engine's /v1/models (router/adapters.py)."""
    path = str(real_env.model / f"lora-{ADAPTER}")
    with running_router(tmp_path, [router_pod(lora_engine)], adapters_check_interval_s=0.2) as base:
        def listed() -> dict[str, str | None]:
            return {m["id"]: m["parent"] for m in http().get(base + "/v1/models").json()["data"]}

        wait_for(lambda: ADAPTER in listed(), 10, "the engine's adapter listed")
        body = {"model": "sql-later", "prompt": text(5, 40), "max_tokens": 2}
        assert http().post(base + "/v1/completions", json=body).status_code == 404
        r = http().post(lora_engine.url + "/v1/load_lora_adapter", json={"lora_name": "sql-later", "lora_path": path})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql-later' added successfully.", r.text
        r = http().post(lora_engine.url + "/v1/load_lora_adapter", json={"lora_name": "sql-later", "lora_path": path})
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidUserInput", r.text   # as the simulator
        wait_for(lambda: listed().get("sql-later") == MODEL_NAME, 10, "the loaded adapter listed")
        r = http().post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "lora", r.text
        assert r.json()["model"] == "sql-later", r.text
        r = http().post(lora_engine.url + "/v1/unload_lora_adapter", json={"lora_name": "sql-later"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql-later' removed successfully.", r.text
        wait_for(lambda: "sql-later" not in listed(), 10, "the unloaded adapter gone")
        r = http().post(base + "/v1/completions", json=body)
        assert r.status_code == 404 and "sql-later" in r.json()["error"]["message"], r.text
        r = http().post(lora_engine.url + "/v1/unload_lora_adapter", json={"lora_name": "sql-later"})
        assert r.status_code == 404 and r.json()["error"] == {   # the simulator's words (tests/test_sim_lora.py)
            **r.json()["error"], "type": "NotFoundError", "message": "The lora adapter 'sql-later' cannot be found."}
