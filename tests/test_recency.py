"""Block recency: which cached blocks a pod should have evicted by the time a queued request starts,
and the self-check that learns how often that expectation comes true."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from indexer.events import BlockRemoved, BlockStored
from indexer.index import PrefixIndex
from indexer.keys import prompt_keys
from indexer.recency import RATE_WINDOW_S, BlockRecency
from tests.test_index import BS, MODEL, Clock  # the index tests' block size, model and settable clock


def evict(rec, pod, n, clock, dt=0.0):
    """The pod evicted ``n`` blocks the router never saw (they only set the eviction rate)."""
    rec.removed(pod, [10_000_000 + i for i in range(n)])
    clock.t += dt


def test_nothing_is_cut_before_the_pod_has_evicted_anything():
    clock = Clock()
    rec = BlockRecency(clock)
    rec.release("a", [1, 2, 3])
    assert rec.eviction_rate("a") == 0.0
    assert rec.surviving("a", [1, 2, 3], 3, clock.t + 60) == 3
    assert rec.surviving("unknown", [1, 2, 3], 3, clock.t + 60) == 3


def test_idle_blocks_go_in_the_order_they_were_freed_tail_first():
    clock = Clock()
    rec = BlockRecency(clock)
    old, new = [1, 2, 3, 4], [1, 2, 5, 6, 7, 8]   # two prompts sharing their first two blocks
    rec.hold("a", old)
    rec.release("a", old)                  # 1-4 idle since 100
    clock.t = 101.0
    rec.hold("a", new)
    rec.release("a", new)                  # 1, 2, 5-8 idle since 101; 3, 4 still since 100
    evict(rec, "a", 5 * int(RATE_WINDOW_S), clock)  # 5 blocks/s
    assert rec.eviction_rate("a") == 5.0
    # within 0.2 s: one block goes, the oldest freed (3 or 4): ``new`` keeps all of its six
    assert rec.surviving("a", new, 6, clock.t + 0.2) == 6
    # within 0.9 s, 4.5 blocks: 3 and 4 (freed first), then the two deepest of ``new``'s batch
    assert rec.surviving("a", new, 6, clock.t + 0.9) == 4
    # within 2 s, 10 blocks: everything idle is gone (the shared head too)
    assert rec.surviving("a", new, 6, clock.t + 2.0) == 0
    # now: nothing is evicted before the request starts
    assert rec.surviving("a", new, 6, clock.t) == 6


def test_blocks_in_use_are_never_cut_and_a_removal_forgets_them():
    clock = Clock()
    rec = BlockRecency(clock)
    rec.hold("a", [1, 2, 3])
    evict(rec, "a", 100, clock)
    assert rec.surviving("a", [1, 2, 3], 3, clock.t + 10) == 3
    rec.release("a", [1, 2, 3])
    assert rec.stats("a")["idle_blocks"] == 3
    assert rec.surviving("a", [1, 2, 3], 3, clock.t + 10) == 0
    rec.removed("a", [3])
    assert rec.stats("a")["idle_blocks"] == 2
    rec.hold("a", [1])
    assert rec.stats("a")["idle_blocks"] == 1
    # the rate forgets evictions older than its window
    clock.t += RATE_WINDOW_S + 1
    assert rec.eviction_rate("a") == 0.0


def test_memory_is_bounded_per_pod():
    clock = Clock()
    rec = BlockRecency(clock, max_blocks_per_pod=64)
    for i in range(50):
        rec.release("a", list(range(i * 10, i * 10 + 10)))
        clock.t += 1
    st = rec.stats("a")
    assert st["blocks"] <= 64
    assert st["idle_blocks"] == st["blocks"]


def test_the_self_check_learns_how_often_an_expected_eviction_comes_true():
    clock = Clock()
    rec = BlockRecency(clock)
    assert 0.1 < rec.precision() < 0.2     # no evidence yet: the prior's 10th percentile, about 0.13
    for k in range(20):                    # expected evictions that the pod then recomputes
        rec.expect_evicted("a", k, within_s=1.0)
        rec.stored("a", [k, 999])
    high = rec.precision()
    assert high > 0.85 and rec.checks["eviction_checks_confirmed"] == 20
    for k in range(100, 140):              # expected evictions that never come: the blocks were hit
        rec.expect_evicted("a", k, within_s=1.0)
    assert rec.watching
    clock.t += 1.5
    low = rec.precision()
    assert low < 0.4 and rec.checks["eviction_checks_refuted"] == 40 and not rec.watching
    rec.stored("b", [5])                   # another pod's store confirms nothing
    assert rec.precision() == low


def test_the_index_feeds_removals_and_stores_to_recency():
    clock = Clock()
    ix = PrefixIndex(block_size=BS, clock=clock)
    ix.add_pod("a", MODEL)
    tokens = list(range(3 * BS))
    keys = prompt_keys(tokens, BS, MODEL)
    rec = ix.recency
    rec.hold("a", keys)
    rec.release("a", keys)
    ix.apply_event("a", BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=tokens,
                                    block_size=BS, medium="GPU"))
    rec.expect_evicted("a", keys[2], within_s=5.0)
    ix.apply_event("a", BlockRemoved(block_hashes=[3], medium="GPU"))
    assert rec.stats("a")["idle_blocks"] == 2 and rec.eviction_rate("a") > 0
    ix.apply_event("a", BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=tokens[2 * BS:],
                                    block_size=BS, medium="GPU"))
    assert rec.checks["eviction_checks_confirmed"] == 1
    assert ix.stats()["eviction_checks_confirmed"] == 1   # /metrics: kvroute_index_operations_total
    ix.clear_pod("a")
    assert rec.stats("a")["blocks"] == 0


def test_the_snapshot_counts_blocks_expected_evicted_as_work():
    from router.booking import Ledger
    from router.config import PodConfig
    from router.pods import PodState
    from router.routing import take_snapshot
    from router.scheduling.calibrator import Calibrator

    clock = Clock()
    ix = PrefixIndex(block_size=BS, clock=clock)
    ix.add_pod("a", MODEL)
    tokens = list(range(4 * BS))
    keys = prompt_keys(tokens, BS, MODEL)
    ix.apply_event("a", BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=tokens,
                                    block_size=BS, medium="GPU"))
    ix.recency.hold("a", keys)
    ix.recency.release("a", keys)
    ledger = Ledger(clock)
    cal = Calibrator(1000.0, 0.0)            # 1,000 tokens/s
    pod = PodState(config=PodConfig(id="a", url="http://a", model=MODEL), healthy=True)

    def snap():
        return take_snapshot(MODEL, [pod], keys, tokens, index=ix, ledger=ledger, calibrator=cal,
                             block_size=BS, salts={}).candidate("a")

    assert snap().cached_tokens == 4 * BS and snap().evicting_tokens == 0
    for _ in range(5):                        # 10 blocks/s evicted, none of them this prompt's
        evict(ix.recency, "a", 2 * int(RATE_WINDOW_S), clock)
    ledger.book("a", 500)                     # 0.5 s of work queued ahead: 5 blocks evicted meanwhile
    c = snap()
    assert c.evicting_tokens == 4 * BS and 0 <= c.evicting_check < 4
    # no check has come back yet: about an eighth of the expected loss is counted (one block of four)
    assert c.cached_tokens == 3 * BS
    for k in range(30):                       # the expectation has held every time lately
        ix.recency.expect_evicted("a", -k - 1, 1.0)
        ix.recency.stored("a", [-k - 1])
    assert snap().cached_tokens == 0


@given(st.lists(st.sampled_from([None, 1.0, 2.0, 3.0, float("inf")]), max_size=60))
def test_runs_of_last_use_times_count_every_key(values):
    from collections import Counter

    from indexer.recency import _runs

    table = dict(enumerate(values))
    runs = _runs(table.get, list(range(len(values))))
    total: Counter = Counter()
    for v, n in runs:
        total[v] += n
    assert total == Counter(values)
    assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))   # runs, not single keys
