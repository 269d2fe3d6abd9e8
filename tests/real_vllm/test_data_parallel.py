"""A real data-parallel pod (``vllm serve --data-parallel-size 2``: two engines behind one API port).

vLLM offsets each rank's event and replay sockets by its rank and labels its metrics by ``engine``;
its own balancer does not look at the prefix cache. The router makes a candidate of each engine
(``dp#0``, ``dp#1``), indexes each from its own stream, and sends a request to the engine it chose
with ``X-data-parallel-rank``; a follow-up is credited exactly what that engine then hits.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from realvllm import engines as rv
from realvllm.engines import MODEL_NAME, router_pod
from router.config import PodConfig, data_parallel_ranks
from router.pods import PodRegistry, parse_vllm_metrics
from tests.helpers import http
from tests.real_vllm.conftest import (
    _AggPair,
    cached_tokens,
    debug_route,
    engine_metric,
    running_router,
    wait_for,
    wait_indexed,
)

WORDS = "river stone cloud lantern meadow harbor copper violet thunder orchard signal ember".split()

# a tiny Mixtral (vLLM 0.32 refuses external-lb data parallelism for dense models: "Non-MoE models do
# not support external data parallel mode"), random weights, the tiny model's tokenizer
MAKE_MOE = """
import shutil, sys, torch
from pathlib import Path
from transformers import MixtralConfig, MixtralForCausalLM
src, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
cfg = MixtralConfig(vocab_size=2824, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
                    pad_token_id=1, tie_word_embeddings=False)
MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
    shutil.copy(src / f, out / f)
"""


@dataclass
class _ExternalRank(rv.Engine):
    """One rank of an external-lb pod: ``vllm serve MOE --data-parallel-size 2 --data-parallel-rank r``,
    an API server of its own fronting that rank's one engine."""

    model: Path = Path()

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[2] = str(self.model)
        return cmd


def test_each_rank_of_an_external_lb_pod_reads_its_own_servers_page(_agg_pair, real_env, real_scratch):
    """vLLM 0.32's rank r in external-lb manages its own engine only (``core_client.py``:
    ``engine_ranks_managed = [r]``): its page carries ``engine="r"`` and that engine's own blocks, not
    the pod's sum, so rank 0's page (a pod's one ``metrics_url``) says nothing of rank 1. With
    ``metrics_urls`` each ``<pod>#<r>`` reads its own. Idle pages only: on this CPU build the pair's
    first forward pass dies (the CPU communicator has no ``all_gatherv`` for the MoE layers' dispatch)."""
    _agg_pair.stop()  # two engines at a time on two cores
    model = real_scratch / "tiny-moe"
    if not (model / "config.json").exists():
        subprocess.run([str(real_env.python), "-c", MAKE_MOE, str(real_env.model), str(model)], check=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, timeout=300,
                       capture_output=True)
    rpc = rv.listen_port()
    ranks = [_ExternalRank(real_env, f"ext-{r}", real_scratch, core=r, num_gpu_blocks=100 + 50 * r, max_model_len=1024,
                           data_parallel_size=2, model=model,
                           extra_args=["--data-parallel-rank", str(r), "--data-parallel-address", "127.0.0.1",
                                       "--data-parallel-rpc-port", str(rpc)]) for r in range(2)]
    with rv.running(ranks):
        pages = [http().get(e.url + "/metrics").text for e in ranks]
        for r, page in enumerate(pages):
            infos = [line for line in page.splitlines() if line.startswith("vllm:cache_config_info{")]
            assert len(infos) == 1 and f'engine="{r}"' in infos[0], infos
            assert f'num_gpu_blocks="{100 + 50 * r}"' in infos[0]  # its own, not the pair's 250
        assert not parse_vllm_metrics(pages[0], "1").seen  # rank 0's page: nothing of rank 1

        async def scrape() -> dict[str, tuple]:
            pod = PodConfig(id="dec", url=ranks[0].url, role="decode", data_parallel_size=2,
                            metrics_urls=[e.url for e in ranks])
            reg = PodRegistry(data_parallel_ranks(pod), timeout_s=10)
            await reg.start()
            try:
                return {k: (p.num_gpu_blocks, p.block_size, p.waiting, p.running) for k, p in reg.pods.items()}
            finally:
                await reg.stop()

        assert asyncio.run(scrape()) == {"dec#0": (100, 32, 0, 0), "dec#1": (150, 32, 0, 0)}


@pytest.fixture(scope="module")
def dp_engine(_agg_pair: _AggPair, real_env: rv.RealEnv, real_scratch: Path) -> Iterator[rv.Engine]:
    """One pod, two data-parallel engines; the aggregated pair is stopped first (four engines on two
    cores would slow every other test)."""
    _agg_pair.stop()
    engine = rv.Engine(real_env, "dp", real_scratch, data_parallel_size=2)
    with rv.running([engine]):
        yield engine


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))


def per_engine(engine: rv.Engine, name: str) -> list[float]:
    return [engine_metric(engine.url, name, engine=str(r)) for r in range(2)]


def test_each_rank_is_indexed_from_its_own_stream(dp_engine, real_env, tmp_path):
    with running_router(tmp_path, [router_pod(dp_engine)], tokenizer=str(real_env.tokenizer)) as base:
        body = {"model": MODEL_NAME, "prompt": text(1, 300), "max_tokens": 2}
        assert sorted(p["pod"] for p in debug_route(base, body)["pods"]) == ["dp#0", "dp#1"]
        # straight to engine 1, past the router: only engine 1's stream announces the blocks
        r = http().post(dp_engine.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "1"})
        assert r.status_code == 200, r.text
        wait_for(lambda: cached_tokens(base, body, "dp#1") > 0, 20, "engine 1's blocks indexed")
        assert cached_tokens(base, body, "dp#0") == 0


def test_follow_ups_go_to_the_engine_holding_them_and_hit_what_was_credited(dp_engine, real_env, tmp_path):
    with running_router(tmp_path, [router_pod(dp_engine)], tokenizer=str(real_env.tokenizer),
                        speculative_ttl_s=0.05) as base:
        for s in (2, 3):
            first = {"model": MODEL_NAME, "prompt": text(s, 500), "max_tokens": 2}
            before_prompt = per_engine(dp_engine, "vllm:prompt_tokens_total")
            r = http().post(base + "/v1/completions", json=first)
            assert r.status_code == 200, r.text
            unit = r.headers["x-kvroute-pod"]
            rank = int(unit.rsplit("#", 1)[1])
            n = r.json()["usage"]["prompt_tokens"]
            # the router's X-data-parallel-rank put it on that engine (vLLM counts the whole prompt there)
            after = per_engine(dp_engine, "vllm:prompt_tokens_total")
            grew = [a - b for a, b in zip(after, before_prompt, strict=True)]
            assert grew == [n if e == rank else 0 for e in range(2)]

            follow = {**first, "prompt": first["prompt"] + " " + text(s + 10, 150)}
            predicted = wait_indexed(base, follow, unit, n, 20)
            hits = per_engine(dp_engine, "vllm:prefix_cache_hits_total")
            r = http().post(base + "/v1/completions", json=follow)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-pod"] == unit, (unit, r.headers["x-kvroute-pod"])
            observed = [a - b for a, b in zip(per_engine(dp_engine, "vllm:prefix_cache_hits_total"), hits, strict=True)]
            print(f"session {s}: {unit}, credited {predicted}, engine hits {observed}")
            assert observed == [predicted if e == rank else 0 for e in range(2)] and predicted > 0


def test_each_engine_counts_its_own_kv_blocks_not_the_pods(dp_engine):
    """vLLM's server shows the sum of its engines' KV blocks under every engine's label
    (``vllm:cache_config_info``); the router's reading of one engine is that engine's own KV cache,
    as its start-up log line reports it."""
    logged: dict[int, int] = {}
    for line in dp_engine.log.read_text(errors="replace").splitlines():
        m = re.search(r"EngineCore_DP(\d+) .*KV cache size: ([\d,]+) tokens", line)
        if m:
            logged[int(m[1])] = int(m[2].replace(",", ""))  # the last start's
    assert sorted(logged) == [0, 1]
    page = http().get(dp_engine.url + "/metrics").text
    for r in range(2):
        seen = parse_vllm_metrics(page, str(r))
        assert seen.num_gpu_blocks is not None and seen.block_size is not None
        assert seen.num_gpu_blocks * seen.block_size == logged[r]
