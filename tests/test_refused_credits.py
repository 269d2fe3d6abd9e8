"""What the router keeps of a request the pod did not take: a refusal (vLLM's 400 for a request it
checks before its engine sees it), a 5xx or a failed connection computes and caches nothing, so the
prompt blocks the router credited to the pod when it routed the request are withdrawn, and the
booking is released without a TTFT learnt or an announcement of blocks expected
(``Lifecycle._unserved``, ``PrefixIndex.withdraw``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from indexer.keys import prompt_keys
from kvcommon.settings import build_settings
from router.config import RouterSettings
from router.lifecycle import Lifecycle
from simulator.testing import consecutive_free_ports, running_sims
from tests.helpers import free_port
from tests.test_e2e_router import fleet
from tests.test_router_api import running_router

BS = 16
HEAD = list(range(1, 1 + 8 * BS))            # 8 full blocks
LONGER = HEAD + list(range(500, 500 + 4 * BS))  # and 4 more


def _credited(services, body: dict) -> dict[str, int]:
    """The router's /debug/route answer, per pod: the cached tokens it gives each pod for ``body``."""
    plan = services.router.plan("completion", body, {}, dry_run=True)
    return {c.pod_id: c.cached_tokens for c in plan.snapshot.candidates}


# ---- the index -------------------------------------------------------------------------------------

def test_withdraw_takes_back_predicted_entries_and_leaves_what_events_stored():
    ix = PrefixIndex(block_size=BS)
    ix.add_pod("a", "m")
    keys = prompt_keys(LONGER, BS, "m")
    # the pod's events hold the first 3 blocks; the route credits the other 9
    ix.apply_event("a", BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=LONGER[:3 * BS],
                                    block_size=BS, medium="GPU"))
    ix.speculate("a", keys)
    assert ix.match(keys)["a"].blocks == 12
    assert ix.withdraw("a", keys) == 9
    assert ix.match(keys)["a"].blocks == 3    # what the events stored stays
    assert ix.stats()["predicted_withdrawn"] == 9 and ix.pod_stats("a")["predicted"] == 0
    assert ix.withdraw("a", keys) == 0 and ix.withdraw("nobody", keys) == 0


def test_a_withdrawn_credit_on_a_pod_without_events_is_credited_again_by_the_next_route():
    """A follow-up skips the head its last turn credited (``credit_steps``' notes): after a
    withdrawal the note must not vouch for blocks that are gone, so the next credit puts them back."""
    ix = PrefixIndex(block_size=BS)
    ix.add_pod("a", "m", approximate=True)
    head, longer = prompt_keys(HEAD, BS, "m"), prompt_keys(LONGER, BS, "m")
    ix.record_route("a", longer)
    ix.withdraw("a", longer[8:])
    assert ix.match(longer)["a"].blocks == 8
    ix.withdraw("a", head)
    assert ix.match(longer)["a"].blocks == 0
    ix.record_route("a", longer)
    assert ix.match(longer)["a"].blocks == 12


# ---- through the router --------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("events", [False, True], ids=["no-events", "kv-events"])
async def test_a_refused_request_leaves_no_credit_and_no_booking(events):
    """vLLM refuses a prompt with a negative token id (400, before its engine sees it): the router
    routed it and credited its blocks to the pod; they are withdrawn, so a request that shares the
    prefix is not drawn to a pod holding none of it. What the pod was credited before (a served
    request's prefix) stays. The refused request's booking is released, no TTFT is learnt from the
    refusal (``max_tokens: 1`` makes an answer's duration a TTFT), and it is not counted among the
    requests whose blocks the pod must announce (the event watchdog's count)."""
    ev = consecutive_free_ports(2) if events else None
    sim_args = ["--timing", "seed", "--block-size", str(BS)] + (["--kv-events-port", str(ev)] if ev else [])
    with running_sims(1, sim_args) as urls:
        settings = build_settings(RouterSettings, {"pods": fleet(urls, ev), "port": free_port(), "block_size": BS,
                                                   "speculative_ttl_s": 60.0})
        async with running_router(settings) as (base, services):
            router = services.router
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                served = await c.post("/v1/completions", json={"model": "sim-model", "prompt": HEAD, "max_tokens": 1})
                assert served.status_code == 200, served.text
                if events:   # the served prompt's blocks come in as the pod's own events
                    for _ in range(200):
                        if services.index.pod_stats("sim-0")["blocks"] >= 8:
                            break
                        await asyncio.sleep(0.05)
                follow = {"model": "sim-model", "prompt": LONGER + [7, 8, 9], "max_tokens": 1}
                assert _credited(services, follow) == {"sim-0": 8 * BS}
                samples = router.calibrator.pod("sim-0").samples
                sources = dict(router.event_sources)
                refused = await c.post("/v1/completions",
                                       json={"model": "sim-model", "prompt": LONGER + [-1], "max_tokens": 1})
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["param"] == f"body.prompt.{len(LONGER)}"
                # the refused prompt's 4 new blocks were credited, and are withdrawn: the head stays
                assert _credited(services, follow) == {"sim-0": 8 * BS}
                assert services.index.stats()["predicted_withdrawn"] == 4
                assert router.ledger.totals().get("sim-0", (0, 0.0)) == (0, 0.0)
                assert router.calibrator.pod("sim-0").samples == samples
                assert router.event_sources == sources
                debug = (await c.post("/debug/route", json=follow)).json()
                assert [(row["pod"], row["cached_tokens"]) for row in debug["pods"]] == [("sim-0", 8 * BS)]


@pytest.mark.e2e
async def test_a_pod_that_fails_is_not_credited_the_prompt_the_next_pod_served():
    """A 5xx before the first byte is retried on the next pod of the ranking: the failed pod's
    credit is withdrawn, the pod that served the request keeps its own."""
    with running_sims(2, ["--timing", "seed", "--block-size", str(BS)]) as urls:
        settings = build_settings(RouterSettings, {"pods": fleet(urls, None), "port": free_port(),
                                                   "block_size": BS, "retries": 1})
        async with running_router(settings) as (base, services):
            body = {"model": "sim-model", "prompt": LONGER, "max_tokens": 2}
            first = services.router.plan("completion", body, {}, dry_run=True).decision.ranked[0].pod_id
            url = urls[int(first.removeprefix("sim-"))]
            async with httpx.AsyncClient(timeout=30) as c:
                (await c.post(url + "/sim/faults", json={"status": 500})).raise_for_status()
                r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            served = r.headers["x-kvroute-pod"]
            assert served != first
            assert _credited(services, body) == {first: 0, served: 12 * BS}


@pytest.mark.e2e
async def test_a_long_prompts_credit_still_coming_in_pieces_is_withdrawn_when_its_last_piece_is_in():
    """A prompt of more than 256 blocks is credited a piece per loop turn (``Router.speculate``): a
    refusal that comes back before the last piece is in withdraws the pieces that come after it too."""
    with running_sims(1, ["--timing", "seed", "--block-size", str(BS)]) as urls:
        settings = build_settings(RouterSettings, {"pods": fleet(urls, None), "port": free_port(), "block_size": BS})
        async with running_router(settings) as (_, services):
            router = services.router
            body = {"model": "sim-model", "prompt": list(range(1, 1 + 1100 * BS)), "max_tokens": 1}
            plan = router.plan("completion", body, {})
            cand = plan.decision.ranked[0]
            booking = router.book(plan, cand)   # the first piece now, the rest in the turns after
            assert 0 < services.index.pod_stats("sim-0")["predicted"] < 1100
            Lifecycle._unserved(router, plan, plan.decision.routes[cand.pod_id], booking)
            for _ in range(100):   # 18 pieces of 64 blocks still to come, one a turn
                await asyncio.sleep(0)
            assert services.index.pod_stats("sim-0")["predicted"] == 0
            assert booking.released and router.ledger.totals().get("sim-0", (0, 0.0)) == (0, 0.0)


# ---- the simulated pod refuses what vLLM refuses ----------------------------------------------------

# vLLM 0.32 types these as a plain ``bool`` (ChatCompletionRequest, CompletionRequest): its pydantic
# model answers a null 400 "Input should be a valid boolean" (checked against the real models)
_REFUSED_NULLS = {
    "completion": ["add_special_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                   "spaces_between_special_tokens", "use_beam_search"],
    "chat": ["add_generation_prompt", "add_special_tokens", "continue_final_message", "echo", "ignore_eos",
             "include_reasoning", "include_stop_str_in_output", "skip_special_tokens",
             "spaces_between_special_tokens", "use_beam_search"],
}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_simulated_pod_refuses_a_null_for_a_switch_vllm_types_a_plain_boolean(kind):
    from indexer.tokens import ByteTokenizer
    from simulator.openai_shapes import ShapeError, parse_generation

    base = {"model": "m", "max_tokens": 2}
    base.update({"prompt": "hello"} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]})

    def parse(body: dict):
        return parse_generation(body, kind, ByteTokenizer(), model="m", max_model_len=4096, default_max_tokens=16,
                                max_prompt_tokens=4096)

    for key in _REFUSED_NULLS[kind]:
        with pytest.raises(ShapeError) as refused:
            parse({**base, key: None})
        assert (refused.value.status, refused.value.param, refused.value.err_type) == (400, f"body.{key}",
                                                                                        "Bad Request"), key
    # nullable in vLLM: a completion's echo (``bool | None``), stream, return_token_ids
    for key in ("echo", "stream", "return_token_ids") if kind == "completion" else ("stream", "return_token_ids"):
        assert parse({**base, key: None}).max_tokens == 2


@pytest.mark.e2e
async def test_a_credit_made_after_a_refusal_stays_though_the_refused_credit_was_still_in_pieces():
    """A long prompt's credit still coming in pieces, its request refused (its credit withdrawn), and
    a new request of the same prompt to the same pod credited straight after: the new credit stays.
    The withdrawal used to be made again once the refused credit's last piece was in, and took the
    newer credit with it."""
    with running_sims(1, ["--timing", "seed", "--block-size", str(BS)]) as urls:
        settings = build_settings(RouterSettings, {"pods": fleet(urls, None), "port": free_port(), "block_size": BS})
        async with running_router(settings) as (_, services):
            router = services.router
            body = {"model": "sim-model", "prompt": list(range(1, 1 + 1100 * BS)), "max_tokens": 1}
            plan = router.plan("completion", body, {})
            cand = plan.decision.ranked[0]
            booking = router.book(plan, cand)   # the first piece now, the rest in the turns after
            Lifecycle._unserved(router, plan, plan.decision.routes[cand.pod_id], booking)
            again = router.plan("completion", body, {})
            router.book(again, again.decision.ranked[0])   # the same prompt to the same pod, credited anew
            for _ in range(200):
                await asyncio.sleep(0)
            assert services.index.pod_stats("sim-0")["predicted"] == 1100
