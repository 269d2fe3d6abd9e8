"""A credit withdrawn by the router process that made it (``Lifecycle._unserved``: the pod did not take
the request) is withdrawn from the other router processes' indexes too: ``Router.withdraw`` shares it
over the booking bus ("w" messages, ``BookingBus.share_withdrawal``) and each receiver takes back the
same credit (``Router.withdraw_foreign``), never what a pod's own KV events stored."""

from __future__ import annotations

import asyncio
import time

import pytest

from indexer.events import BlockStored
from indexer.keys import key_space
from router.bookbus import CREDIT_KEYS_PER_MESSAGE, MAX_PENDING_CREDIT_KEYS, BookingBus, BusCollector
from router.config import PodConfig
from router.lifecycle import Lifecycle
from router.routing import CREDIT_NOW_BLOCKS, LONG_CREDIT_BLOCKS
from tests.helpers import until
from tests.test_booking_bus import two_buses
from whatif.simulate import SimConfig, _build_router


def routers(events: bool, n: int = 2) -> tuple[SimConfig, list]:
    """``n`` routers in front of the same two simulated pods, with or without KV events (as
    tests/test_booking_bus.py builds them)."""
    cfg = SimConfig(pods=2, objective_s=None)
    if not events:
        cfg.router = {"pods": [PodConfig(id=pid, url=f"http://{pid}.simulated:8000", role=role, model=cfg.model)
                               for pid, role in cfg.pod_ids()]}
    return cfg, [_build_router(cfg, time.monotonic) for _ in range(n)]


def wire(router, bus: BookingBus) -> None:
    """As router/service.py wires a router to its bus."""
    bus.key_space = key_space(router.block_size)
    bus.on_credits = router.credit_foreign
    router.on_credit = bus.share_credit
    bus.on_withdrawals = router.withdraw_foreign
    router.on_withdraw = bus.share_withdrawal


def cached(router, cfg: SimConfig, prompt: list[int], pod: str) -> int:
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": 1}
    return router.plan("completion", body, {}, dry_run=True).snapshot.candidate(pod).cached_tokens


def predicted(router, pod: str) -> int:
    return router.index.pod_stats(pod)["predicted"]


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---- unit: the "w" message ------------------------------------------------------------------------
# ---- unit: the receiving router ----------------------------------------------------------------------
@pytest.mark.parametrize("events", [True, False], ids=["events", "no events"])
async def test_a_foreign_withdrawal_is_not_undone_by_the_pieces_of_its_credit_still_to_come(events):
    """Another process's credit of a long prompt is applied a piece per loop turn (``Router.speculate``):
    its withdrawal, applied between two pieces, is applied again once the last piece is in. What
    the pod's events stored stays, and a pod the router does not know is skipped."""
    cfg, (router,) = routers(events, 1)
    pod = "pod-0"
    blocks = LONG_CREDIT_BLOCKS + 76   # > CREDIT_NOW_BLOCKS: in pieces of LONG_CREDIT_PIECE
    assert blocks > CREDIT_NOW_BLOCKS
    prompt = list(range(1, 1 + blocks * router.block_size))
    keys = router.keys_for(cfg.model, prompt)
    assert len(keys) == blocks
    if events:   # the pod's events hold the first 3 blocks
        bs = router.block_size
        router.index.apply_event(pod, BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None,
                                                  token_ids=prompt[:3 * bs], block_size=bs, medium="GPU"))
        assert cached(router, cfg, prompt, pod) == 3 * bs
    stored = 3 * router.block_size if events else 0
    router.credit_foreign(pod, keys)                 # the first piece now, the rest in the turns after
    assert 0 < predicted(router, pod) < blocks
    router.withdraw_foreign(pod, keys)               # between two pieces
    router.withdraw_foreign("no-such-pod", keys)     # skipped
    await turns(2 * blocks // 64 + 10)
    assert predicted(router, pod) == 0
    assert cached(router, cfg, prompt, pod) == stored


# ---- e2e: two routers on one bus ---------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("events", [True, False], ids=["events", "no events"])
async def test_a_credit_the_origin_withdraws_is_withdrawn_by_the_other_router_too(events):
    """Router a routes a prompt and its credit reaches router b; the pod does not take it, so a
    withdraws the credit (``Lifecycle._unserved``), and b, which would otherwise keep it for the
    credit's TTL (2 s with KV events, 120 s without), withdraws it too. A third router on the bus
    that never had the credit is unharmed, and a credit of another prompt at b stays."""
    cfg, (ra, rb) = routers(events)
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        wire(ra, a)
        wire(rb, b)
        prompt = list(range(1, 2001))
        plan = ra.plan("completion", {"model": cfg.model, "prompt": prompt, "max_tokens": 1}, {})
        cand = plan.decision.chosen
        pod = cand.pod_id
        other = list(range(10_001, 10_801))
        rb.credit_foreign(pod, rb.keys_for(cfg.model, other))
        booking = ra.book(plan, cand)
        full = len(prompt) // ra.block_size * ra.block_size
        await until(lambda: cached(rb, cfg, prompt, pod) == full, 5, "a's credit at b")
        Lifecycle._unserved(ra, plan, plan.decision.routes[pod], booking)
        assert cached(ra, cfg, prompt, pod) == 0
        await until(lambda: b.stats.get("withdrawals", "received") >= 1, 5, "a's withdrawal at b")
        await until(lambda: cached(rb, cfg, prompt, pod) == 0, 5, "the credit withdrawn at b")
        assert cached(rb, cfg, other, pod) == len(other) // rb.block_size * rb.block_size
        assert a.stats.get("withdrawals", "sent") == 1 and b.stats.get("bad", "dropped") == 0
        rows = {tuple(s.labels.values()): s.value for m in BusCollector(a).collect() for s in m.samples
                if s.name == "kvroute_booking_bus_messages_total"}
        assert rows[("withdrawals", "sent")] == 1.0


@pytest.mark.e2e
@pytest.mark.parametrize("events", [True, False], ids=["events", "no events"])
async def test_a_long_prompts_credit_withdrawn_in_the_same_flush_stays_withdrawn_on_the_peer(events):
    """A prompt of more than ``LONG_CREDIT_BLOCKS`` blocks, booked and withdrawn once in one loop turn:
    its credit and its withdrawal leave in one flush, in that order, and b applies them in one
    receive pass, the withdrawal while the credit's pieces are still coming in. b's index holds
    none of it once they are all in, without a second withdrawal from a."""
    cfg, (ra, rb) = routers(events)
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        wire(ra, a)
        wire(rb, b)
        prompt = list(range(1, 1 + (LONG_CREDIT_BLOCKS + 76) * ra.block_size))
        plan = ra.plan("completion", {"model": cfg.model, "prompt": prompt, "max_tokens": 1}, {})
        pod = plan.decision.chosen.pod_id
        ra.book(plan, plan.decision.chosen)
        assert ra.withdraw(pod, plan.keys) > 0
        await until(lambda: b.stats.get("withdrawals", "received") == 1, 5, "a's withdrawal at b")
        assert b.stats.get("credits", "received") == 1
        await turns(2 * len(plan.keys) // 64 + 10)   # every piece of the credit in, and more
        assert predicted(rb, pod) == 0 and cached(rb, cfg, prompt, pod) == 0
        assert a.stats.get("withdrawals", "sent") == 1


@pytest.mark.e2e
async def test_credits_and_withdrawals_of_one_flush_arrive_in_their_order_and_the_queue_is_bounded():
    """A credit, its withdrawal and a new credit of the same keys within one flush: b ends with the
    credit, as a does. A withdrawal longer than a message sends its first keys (its credit sent no
    more); past ``MAX_PENDING_CREDIT_KEYS`` queued, a withdrawal is dropped and counted."""
    async with two_buses(snapshot_s=5.0, peer_timeout_s=10.0) as (a, b):
        got: list = []
        a.key_space = b.key_space = "16:abc"
        b.on_credits = lambda pod, keys: got.append(("c", pod, keys))
        b.on_withdrawals = lambda pod, keys: got.append(("w", pod, keys))
        keys = list(range(100, 400))
        a.share_credit("p0", keys)
        a.share_withdrawal("p0", keys[10:])
        a.share_credit("p0", keys)
        a.share_withdrawal("p1", [])        # nothing to send
        assert a.stats.get("withdrawals", "sent") == 0
        await until(lambda: len(got) == 3, 5, "the credits and the withdrawal")
        assert got == [("c", "p0", keys), ("w", "p0", keys[10:]), ("c", "p0", keys)]
        assert a.stats.get("credits", "sent") == 2 and a.stats.get("withdrawals", "sent") == 1
        got.clear()
        a.share_withdrawal("p1", list(range(CREDIT_KEYS_PER_MESSAGE + 50)))
        for k in range(MAX_PENDING_CREDIT_KEYS // CREDIT_KEYS_PER_MESSAGE):
            a.share_withdrawal("p2", list(range(k, k + CREDIT_KEYS_PER_MESSAGE)))
        assert a.stats.get("withdrawals", "dropped") == 1
        await until(lambda: len(got) == MAX_PENDING_CREDIT_KEYS // CREDIT_KEYS_PER_MESSAGE, 5, "the withdrawals")
        assert got[0] == ("w", "p1", list(range(CREDIT_KEYS_PER_MESSAGE)))


# ---- review: a withdrawal between a credit and a new credit of the same keys; its cost ----------------
@pytest.mark.parametrize("events", [True, False], ids=["events", "no events"])
async def test_a_credit_made_after_a_foreign_withdrawal_stays_though_an_older_credit_was_still_in_pieces(events):
    """A credit of a long prompt, its withdrawal and a new credit of the same keys, applied in that
    order (one receive pass, as the origin made them): the receiver ends with the credit, as the
    origin does. The withdrawal applied again once the older credit's last piece was in took the
    newer credit's pieces with it (12 of 1,100 blocks were left)."""
    cfg, (router,) = routers(events, 1)
    pod = "pod-0"
    prompt = list(range(1, 1 + (LONG_CREDIT_BLOCKS + 76) * router.block_size))
    keys = router.keys_for(cfg.model, prompt)
    router.credit_foreign(pod, keys)
    router.withdraw_foreign(pod, keys)
    router.credit_foreign(pod, keys)
    await turns(4 * len(keys) // 64 + 10)
    assert predicted(router, pod) == len(keys)
    assert cached(router, cfg, prompt, pod) == len(keys) * router.block_size
    assert router._in_pieces == {}


async def test_foreign_withdrawals_cost_one_index_withdrawal_each_however_many_credits_are_in_pieces():
    """Each foreign withdrawal is one ``PrefixIndex.withdraw``, whatever the number of the pod's credits
    going in pieces when it comes: it was applied again after each of them (C credits and W
    withdrawals: (C + 1) x W index withdrawals, 2,550 for 50 and 50, quadratic in what a peer, or a
    forger on an unkeyed bus, sends)."""
    cfg, (router,) = routers(False, 1)
    pod = "pod-0"
    calls = []
    withdraw = router.index.withdraw
    router.index.withdraw = lambda p, k: calls.append(p) or withdraw(p, k)
    for c in range(20):
        first = 1 + c * 1_000_000
        prompt = list(range(first, first + (LONG_CREDIT_BLOCKS + 76) * router.block_size))
        router.credit_foreign(pod, router.keys_for(cfg.model, prompt))
    for w in range(20):
        router.withdraw_foreign(pod, list(range(w * 1000, w * 1000 + 1000)))
    await turns(200)
    assert len(calls) == 20
    assert router._in_pieces == {}
