"""The prefix index: every rule, then a property test against a brute-force model."""

from __future__ import annotations

import logging
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import bigmap
from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored
from indexer.index import PrefixIndex
from indexer.keys import prompt_keys
from indexer.recency import BlockRecency

BS = 4
MODEL = "m"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def stored(hashes, parent, tokens, medium="GPU", bs=BS, **kw):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=bs, medium=medium, **kw)


def toks(n_blocks, base=0):
    return [base + i for i in range(n_blocks * BS)]


def new_index(**kw):
    ix = PrefixIndex(block_size=BS, **kw)
    for p in ("a", "b", "c"):
        ix.add_pod(p, MODEL)
    return ix


def keys_of(tokens, lora=None):
    return prompt_keys(tokens, BS, MODEL, lora)


def test_store_then_match_counts_leading_blocks_for_all_pods():
    ix = new_index()
    t = toks(6)
    ix.apply_event("a", stored([1, 2, 3, 4], None, t[:16]))
    ix.apply_event("b", stored([1, 2], None, t[:8]))
    m = ix.match(keys_of(t))
    assert (m["a"].blocks, m["b"].blocks, m["c"].blocks) == (4, 2, 0)
    assert m["a"].by_tier == {"GPU": 4} and m["a"].weighted == 4.0


def test_parent_hash_continues_the_chain():
    ix = new_index()
    t = toks(4)
    ix.apply_event("a", stored([10, 11], None, t[:8]))
    ix.apply_event("a", stored([12, 13], 11, t[8:]))
    assert ix.match(keys_of(t))["a"].blocks == 4


def test_unknown_parent_is_counted_not_guessed():
    ix = new_index()
    t = toks(4)
    assert ix.apply_event("a", stored([12, 13], 99, t[8:]))
    assert ix.match(keys_of(t))["a"].blocks == 0
    assert ix.stats()["orphan_blocks"] == 2


def test_an_evicted_tail_ends_the_match_and_a_missing_first_block_ends_it_at_once():
    ix = new_index()
    t = toks(4)
    ix.apply_event("a", stored([1, 2, 3, 4], None, t))
    ix.apply_event("a", BlockRemoved(block_hashes=[3, 4], medium="GPU"))  # vLLM evicts a prompt's tail first
    assert ix.match(keys_of(t))["a"].blocks == 2
    ix.apply_event("a", BlockRemoved(block_hashes=[1], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks == 0


def test_a_hole_vllm_would_not_leave_is_stepped_over_to_the_end_of_a_run():
    """The match bisects (a pod's blocks along a prompt are a leading run): a block missing from the
    middle of the index's run, as a lost BlockStored leaves, does not end the match where a walk
    would; the answer is the end of a run of held blocks."""
    ix = new_index()
    t = toks(4)
    ix.apply_event("a", stored([1, 2, 3, 4], None, t))
    ix.apply_event("a", BlockRemoved(block_hashes=[2], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks == 4
    ix.apply_event("a", BlockRemoved(block_hashes=[4], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks in (1, 3)


def test_removed_maps_engine_hashes_to_keys_and_unknown_removals_are_counted():
    ix = new_index()
    t = toks(2)
    ix.apply_event("a", stored([1, 2], None, t))
    ix.apply_event("a", BlockRemoved(block_hashes=[2, 77], medium="GPU"))
    assert ix.blocks_of("a") == {keys_of(t)[0]}
    assert ix.stats()["unknown_removals"] == 1


def test_a_second_copy_of_a_block_outlives_the_first_copys_eviction():
    # two requests with one prompt computed it at once: vLLM keeps two blocks per hash, announces both
    # and removes each on its own eviction; the prefix stays cached until the last copy goes
    ix = new_index()
    t = toks(2)
    ix.apply_event("a", stored([1, 2], None, t))
    ix.apply_event("a", stored([1, 2], None, t))
    ix.apply_event("a", stored([2], 1, t[4:]))        # a third copy of the second block, one per event
    assert ix.stats()["duplicate_copies"] == 3 and ix.pod_stats("a")["copies"] == 3
    ix.apply_event("a", BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks == 2
    ix.apply_event("a", BlockRemoved(block_hashes=[2], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks == 2
    ix.apply_event("a", BlockRemoved(block_hashes=[2], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks == 1
    ix.apply_event("a", BlockRemoved(block_hashes=[1], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks == 0
    assert ix.stats()["copies_removed"] == 3 and ix.stats()["unknown_removals"] == 0
    # copies are per tier: a CPU copy is not a second GPU copy, and a clear forgets them all
    ix.apply_event("a", stored([1], None, t[:4]))
    ix.apply_event("a", stored([1], None, t[:4], medium="CPU"))
    ix.apply_event("a", BlockRemoved(block_hashes=[1], medium="GPU"))
    m = ix.match(keys_of(t))["a"]
    assert m.blocks == 1 and m.by_tier == {"CPU": 1}
    ix.apply_event("a", stored([1], None, t[:4], medium="CPU"))
    ix.apply_event("a", AllBlocksCleared())
    ix.apply_event("a", stored([1], None, t[:4]))
    ix.apply_event("a", BlockRemoved(block_hashes=[1], medium="GPU"))
    assert ix.match(keys_of(t))["a"].blocks == 0 and ix.pod_stats("a")["copies"] == 0


def test_a_hash_twice_in_one_event_is_refused_and_leaves_nothing_behind():
    # a chained hash cannot repeat within one chain; taken, the hash named only its last key while the
    # pod's bit stayed on all of them, so no removal, clear or cap could take those keys back
    ix = new_index()
    t = toks(3)
    assert not ix.apply_event("a", stored([7, 7, 7], None, t))
    assert not ix.apply_event("a", stored([5, 6, 5], None, toks(3, 100)))
    ix.apply_event("a", stored([1], None, t[:4]))
    assert not ix.apply_event("a", stored([1, 8, 8], None, t))    # a hash it holds already, then a repeat
    assert ix.match(keys_of(t))["a"].blocks == 1 and ix.match(keys_of(toks(3, 100)))["a"].blocks == 0
    assert ix.stats()["malformed_events"] == 3 and ix.pod_stats("a")["blocks"] == 1
    ix.apply_event("a", AllBlocksCleared())
    assert ix.stats()["keys"] == 0


def test_tiers_and_lora_seeds_a_pod_names_are_bounded():
    # each tier is a map of its own that every match reads, and each LoRA name a remembered seed: a pod
    # that names new ones without end must not grow either without end
    from indexer.index import MAX_SEEDS, MAX_TIERS
    ix = new_index()
    for i in range(MAX_TIERS + 5):
        ix.apply_event("a", stored([1000 + i], None, toks(1, 10 * i), medium=f"M{i}"))
    assert len(ix.stats()["keys_by_tier"]) == MAX_TIERS and ix.stats()["tier_limit"] == 5
    assert ix.apply_event("a", stored([1], None, toks(1, 900), medium="M0"))   # a known tier still takes blocks
    for i in range(MAX_SEEDS + 50):
        assert ix.apply_event("a", stored([5000 + i], None, toks(1, 2000 + i), medium="M0", lora_name=f"adapter-{i}"))
    assert len(ix._pods["a"].seeds) == MAX_SEEDS
    t = toks(1, 2000 + MAX_SEEDS + 10)   # past the bound, a seed is computed as before: the keys agree
    assert ix.match(keys_of(t, lora=f"adapter-{MAX_SEEDS + 10}"))["a"].blocks == 1


def test_a_hashs_copies_on_two_tiers_are_counted_apart_and_forgotten_together():
    ix = new_index(max_blocks_per_pod=32)
    t = toks(1)
    for medium in ("GPU", "GPU", "GPU", "CPU", "CPU"):
        ix.apply_event("a", stored([1], None, t, medium=medium))
    assert ix.pod_stats("a")["copies"] == 3                          # two more on the GPU, one more on the CPU
    ix.apply_event("a", BlockRemoved(block_hashes=[1], medium="CPU"))
    assert ix.pod_stats("a")["copies"] == 2 and ix.match(keys_of(t))["a"].by_tier == {"GPU": 1, "CPU": 1}
    ix.apply_event("a", BlockRemoved(block_hashes=[1], medium="GPU"))
    assert ix.pod_stats("a")["copies"] == 1
    # the cap evicts hash 1 (the oldest), and its copies go with it on every tier
    ix.apply_event("a", stored(list(range(100, 140)), None, toks(40, 1000)))
    assert ix.match(keys_of(t))["a"].blocks == 0 and ix.pod_stats("a")["copies"] == 0


def test_a_hybrid_models_sliding_window_group_neither_stores_nor_removes_the_full_attention_prefix():
    # a hybrid model (full attention + sliding window) stores and evicts the same hashes per group; the
    # window drops old blocks early, and only the full-attention group decides a prefix hit
    ix = new_index()
    t = toks(3)
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    window = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    ix.apply_event("a", stored([1, 2, 3], None, t, **full))
    ix.apply_event("a", stored([1, 2, 3], None, t, **window))
    ix.apply_event("a", stored([9], None, toks(1, 500)[:2], bs=2, **window))  # its own block size: harmless
    assert ix.pod_stats("a")["block_size_mismatch"] is None and ix.pod_stats("a")["copies"] == 0
    ix.apply_event("a", BlockRemoved(block_hashes=[1, 2], medium="GPU", group_idx=1))  # out of the window
    assert ix.match(keys_of(t))["a"].blocks == 3
    assert ix.stats()["skipped_group"] == 1 and ix.stats()["unknown_removals"] == 0
    ix.apply_event("a", BlockRemoved(block_hashes=[2, 3], medium="GPU", group_idx=0))
    assert ix.match(keys_of(t))["a"].blocks == 1
    # a second full-attention group: the first one seen decides (no double counting as copies)
    ix.apply_event("a", stored([1, 2, 3], None, t, group_idx=2, kv_cache_spec_kind="full_attention"))
    assert ix.match(keys_of(t))["a"].blocks == 1 and ix.pod_stats("a")["copies"] == 0


def test_a_remote_shared_tier_is_a_tier_of_its_own_with_its_own_weight():
    # an offloading connector reports blocks it put in a shared store as locality REMOTE: not the pod's own
    # cache, so a tier of its own (configurable weight), removed by its own removals
    ix = new_index(tier_weights={"GPU": 1.0, "CPU": 0.8, "OBJ@REMOTE": 0.25})
    t = toks(2)
    ix.apply_event("a", stored([1], None, t[:4]))
    ix.apply_event("a", stored([1, 2], None, t, medium="OBJ", locality="REMOTE"))
    ix.apply_event("a", stored([1, 2], None, t, medium="CPU", ownership="kvcr"))
    m = ix.match(keys_of(t))["a"]
    assert m.by_tier == {"GPU": 1, "OBJ@REMOTE": 2, "CPU/KVCR": 2} and m.blocks == 2
    assert m.weighted == 1.0 + 0.5 * 1   # GPU's block, then CPU/KVCR (default 0.5) beats OBJ@REMOTE (0.25)
    ix.apply_event("a", BlockRemoved(block_hashes=[2], medium="CPU", ownership="kvcr"))
    ix.apply_event("a", BlockRemoved(block_hashes=[2], medium="OBJ"))   # LOCAL: not the remote tier's
    assert ix.match(keys_of(t))["a"].by_tier == {"GPU": 1, "OBJ@REMOTE": 2, "CPU/KVCR": 1}
    assert ix.stats()["unknown_removals"] == 1


def test_all_blocks_cleared_and_clear_pod():
    ix = new_index()
    t = toks(2)
    ix.apply_event("a", stored([1, 2], None, t))
    ix.apply_event("b", stored([1, 2], None, t))
    ix.apply_event("a", AllBlocksCleared())
    m = ix.match(keys_of(t))
    assert m["a"].blocks == 0 and m["b"].blocks == 2
    ix.clear_pod("b")
    assert ix.match(keys_of(t))["b"].blocks == 0
    assert ix.stats()["keys"] == 0


def test_dp_ranks_are_separate_sources_and_the_best_rank_wins():
    ix = new_index()
    t = toks(3)
    ix.apply_event("a", stored([1], None, t[:4]), dp_rank=0)
    ix.apply_event("a", stored([5, 6, 7], None, t), dp_rank=1)
    m = ix.match(keys_of(t))["a"]
    assert m.blocks == 3 and m.dp_rank == 1
    ix.clear_pod("a", dp_rank=1)
    m = ix.match(keys_of(t))["a"]
    assert m.blocks == 1 and m.dp_rank == 0


def test_bogus_dp_ranks_are_refused():
    ix = new_index(max_dp_ranks=4)
    t = toks(1)
    assert ix.apply_event("a", stored([1], None, t), dp_rank=3)
    assert ix.apply_event("a", stored([1], None, t), dp_rank=4) is False
    assert ix.apply_event("a", stored([1], None, t), dp_rank=-1) is False
    assert ix.pod_stats("a")["dp_ranks"] == [0, 3] and ix.stats()["malformed_events"] == 2


def test_remove_pod_leaves_at_once_and_its_bit_is_reused_cleanly():
    ix = new_index()
    t = toks(2)
    ix.apply_event("a", stored([1, 2], None, t))
    assert ix.remove_pod("a")
    assert "a" not in ix.match(keys_of(t))
    ix.add_pod("d", MODEL)  # takes the freed bit
    assert ix.match(keys_of(t))["d"].blocks == 0
    assert ix.apply_event("a", stored([3], None, t[:4])) is False
    assert ix.stats()["unknown_pod_events"] == 1


def test_models_and_loras_do_not_collide():
    ix = new_index()
    ix.add_pod("x", "other-model")
    t = toks(2)
    ix.apply_event("x", stored([1, 2], None, t))
    ix.apply_event("a", stored([1, 2], None, t, lora_name="ad1"))
    assert ix.match(keys_of(t))["x"].blocks == 0 and ix.match(keys_of(t))["a"].blocks == 0
    assert ix.match(keys_of(t, "ad1"))["a"].blocks == 2
    assert ix.match(prompt_keys(t, BS, "other-model"))["x"].blocks == 2


def test_tier_weights_follow_gpu_then_offload_order():
    ix = new_index(tier_weights={"GPU": 1.0, "CPU": 0.5})
    t = toks(4)
    ix.apply_event("a", stored([1, 2, 3, 4], None, t, medium="CPU"))
    ix.apply_event("a", stored([1, 2], None, t[:8], medium="GPU"))
    ix.apply_event("b", stored([1, 2, 3], None, t[:12], medium="GPU"))
    m = ix.match(keys_of(t))
    assert m["a"].blocks == 4 and m["a"].by_tier == {"GPU": 2, "CPU": 4}
    assert m["a"].weighted == 2 * 1.0 + 2 * 0.5
    assert m["b"].weighted == 3.0 and m["b"].by_tier == {"GPU": 3}
    # evicted from GPU: still on CPU
    ix.apply_event("a", BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    m = ix.match(keys_of(t))
    assert m["a"].blocks == 4 and m["a"].by_tier == {"CPU": 4} and m["a"].weighted == 2.0
    ix.apply_event("a", BlockRemoved(block_hashes=[1], medium="CPU"))
    assert ix.match(keys_of(t))["a"].blocks == 0
    assert keys_of(t)[0] not in ix.blocks_of("a")


def test_hash_only_offload_events_join_known_hashes():
    ix = new_index()
    t = toks(3)
    ix.apply_event("a", stored([1, 2, 3], None, t))
    ix.apply_event("a", stored([1, 2, 99], None, [], medium="CPU"))
    m = ix.match(keys_of(t))["a"]
    assert m.by_tier == {"GPU": 3, "CPU": 2}
    assert ix.stats()["hash_only_joined"] == 2 and ix.stats()["hash_only_unknown"] == 1


def test_block_size_mismatch_is_loud_and_refused(caplog):
    ix = new_index()
    with caplog.at_level(logging.ERROR, logger="kvroute.indexer"):
        ok = ix.apply_event("a", stored([1], None, list(range(16)), bs=16))
    assert ok is False
    assert ix.stats()["block_size_mismatches"] == 1 and ix.stats()["refused_events"] == 1
    assert "block size 16" in caplog.text
    assert ix.pod_stats("a")["block_size_mismatch"] == 16
    assert ix.check_block_size("a", 16) is False


def test_block_size_is_learned_when_not_configured():
    ix = PrefixIndex(block_size=None)
    ix.add_pod("a", MODEL)
    assert ix.apply_event("a", stored([1], None, list(range(8)), bs=8))
    assert ix.block_size == 8
    assert ix.apply_event("a", stored([2], None, list(range(4)), bs=4)) is False


def test_token_count_must_match_block_count():
    ix = new_index()
    assert ix.apply_event("a", stored([1, 2], None, toks(1))) is False
    assert ix.stats()["malformed_events"] == 1


def test_sliding_window_groups_are_not_indexed():
    ix = new_index()
    ix.apply_event("a", stored([1], None, toks(1), kv_cache_spec_kind="sliding_window"))
    assert ix.stats()["skipped_kind"] == 1 and ix.blocks_of("a") == set()


def test_cap_evicts_oldest_first():
    ix = new_index(max_blocks_per_pod=16)
    t = toks(20)
    keys = keys_of(t)
    for i in range(20):
        ix.apply_event("a", stored([i], None if i == 0 else i - 1, t[i * BS:(i + 1) * BS]))
    held = ix.blocks_of("a")
    assert len(held) <= 16
    assert keys[0] not in held and keys[19] in held
    assert ix.pod_stats("a")["evicted"] >= 4
    assert ix.match(keys)["a"].blocks == 0  # the head is gone, so nothing leads


def test_speculative_credit_expires_unless_confirmed():
    clock = Clock()
    ix = new_index(speculative_ttl_s=2.0, clock=clock)
    t = toks(3)
    k = keys_of(t)
    ix.speculate("b", k)
    assert ix.match(k)["b"].blocks == 3
    clock.t += 1.0
    ix.apply_event("b", stored([1, 2], None, t[:8]))  # confirms the first two
    clock.t += 1.5
    assert ix.match(k)["b"].blocks == 2  # the third expired, the confirmed two stay
    assert ix.stats()["predicted_confirmed"] == 2 and ix.stats()["predicted_expired"] == 1
    assert ix.stats()["predicted_keys"] == 0


def test_a_follow_up_credits_only_the_blocks_the_pods_events_do_not_hold():
    """Routing a follow-up turn to the pod that holds its history credits only the new blocks: the
    held ones stay the events' to keep or evict, so an eviction shows at once, not after the TTL."""
    clock = Clock()
    ix = new_index(speculative_ttl_s=2.0, clock=clock)
    t = toks(5)
    k = keys_of(t)
    ix.apply_event("b", stored([1, 2, 3], None, t[:3 * BS]))  # the history: three blocks
    ix.speculate("b", k)  # the follow-up: five
    assert ix.match(k)["b"].blocks == 5
    assert ix.stats()["predicted_keys"] == 2  # only the two new blocks are credited
    ix.apply_event("b", BlockRemoved(block_hashes=[2, 3], medium="GPU"))
    assert ix.match(k)["b"].blocks == 1  # the eviction counts now


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=6),
       st.integers(1, 40))
def test_the_match_bisects_to_what_a_walk_block_by_block_finds(pods, prompt):
    """Each pod holds a leading run of the prompt's blocks by events and may have a credit after it,
    from where the run ended or past a gap (the run's tail evicted after the credit): the bisection
    finds every pod's depth as a walk would, and ``speculate`` credits only what the events do not
    hold."""
    clock = Clock()
    ix = new_index(speculative_ttl_s=2.0, clock=clock)
    longest = max(max(h + g + c for h, g, c in pods), prompt)
    t = toks(longest)
    k = keys_of(t)
    want = {}
    for i, (held, gap, credit) in enumerate(pods):
        pod = f"p{i}"
        ix.add_pod(pod, MODEL)
        if held + gap:
            ix.apply_event(pod, stored(range(1, held + gap + 1), None, t[:(held + gap) * BS]))
        if credit:
            ix.speculate(pod, k[:held + gap + credit])  # credits from where the events' run ends
        if gap:  # then the run's tail is evicted
            ix.apply_event(pod, BlockRemoved(block_hashes=list(range(held + 1, held + gap + 1)), medium="GPU"))
        covered = [j < held or held + gap <= j < held + gap + credit for j in range(prompt)]
        depth = 0
        while depth < prompt and covered[depth]:
            depth += 1
        want[pod] = depth
    got = ix.match(k[:prompt])
    assert {p: got[p].blocks for p in want} == want
    before = ix.stats()["predicted_keys"]
    ix.speculate("p0", k[:prompt])
    held0 = min(pods[0][0], prompt)
    assert ix.match(k[:prompt])["p0"].blocks == prompt
    assert ix.stats()["predicted_keys"] - before <= prompt - held0


def test_a_credit_past_an_evicted_tail_does_not_count_until_the_pod_stores_it_again():
    """A follow-up is routed to the pod that holds its history and its new blocks are credited; then
    the pod evicts the history's tail before the follow-up runs: the match stops where the events'
    run now ends (the credit past the gap does not count), and reaches the credit again once the
    pod computes the tail again. A hole the index holds in the middle of a run (not vLLM's doing) is
    stepped over; a missing first block never is."""
    clock = Clock()
    ix = new_index(speculative_ttl_s=2.0, clock=clock)
    t = toks(12)
    k = keys_of(t)
    ix.apply_event("b", stored(range(1, 9), None, t[:8 * BS]))
    ix.speculate("b", k)
    assert ix.stats()["predicted_keys"] == 4  # blocks 8..11: the new ones
    assert ix.match(k)["b"].blocks == 12
    ix.apply_event("b", BlockRemoved(block_hashes=[6, 7, 8], medium="GPU"))  # blocks 5..7: the tail
    assert ix.match(k)["b"].blocks == 5
    ix.apply_event("b", stored([6, 7, 8], 5, t[5 * BS:8 * BS]))  # the pod computes them again
    assert ix.match(k)["b"].blocks == 12
    ix.apply_event("b", BlockRemoved(block_hashes=[4], medium="GPU"))  # block 3: a hole in the run
    assert ix.match(k)["b"].blocks == 12
    ix.apply_event("b", BlockRemoved(block_hashes=[1], medium="GPU"))  # now the first block goes
    assert ix.match(k)["b"].blocks == 0
    ix.speculate("b", k)
    assert ix.match(k)["b"].blocks == 12  # credited from the start


def test_approximate_mode_learns_from_routes_with_ttl_and_cap():
    clock = Clock()
    ix = PrefixIndex(block_size=BS, approximate_ttl_s=100.0, speculative_ttl_s=1.0, max_blocks_per_pod=32, clock=clock)
    ix.add_pod("n", MODEL, approximate=True)
    ix.add_pod("e", MODEL)
    k = keys_of(toks(5))
    ix.record_route("n", k)
    ix.record_route("e", k)
    clock.t += 50
    m = ix.match(k)
    assert m["n"].blocks == 5 and m["e"].blocks == 0
    clock.t += 60
    assert ix.match(k)["n"].blocks == 0
    for i in range(10):
        ix.record_route("n", keys_of(toks(5, base=1000 * (i + 1))))
    assert ix.pod_stats("n")["predicted"] <= 32 and ix.stats()["predicted_keys"] <= 32
    clock.t += 101
    assert ix.match(k)["n"].blocks == 0 and ix.stats()["predicted_keys"] == 0


def test_an_approximate_pod_is_credited_at_most_its_kv_blocks():
    """vLLM holds at most ``num_gpu_blocks`` blocks and evicts the least recently used: once the router
    knows a pod's capacity, an approximate pod keeps only that many credits, the oldest going first;
    a pod with events is not capped by it (its credits are speculative, its events say what it holds)."""
    clock = Clock()
    ix = PrefixIndex(block_size=BS, approximate_ttl_s=100.0, speculative_ttl_s=100.0, max_blocks_per_pod=1000,
                     clock=clock)
    ix.add_pod("n", MODEL, approximate=True)
    ix.add_pod("e", MODEL)
    prompts = [keys_of(toks(8, base=1000 * (i + 1))) for i in range(4)]  # 32 blocks in all
    for k in prompts[:2]:
        ix.record_route("n", k, capacity=20)
        ix.record_route("e", k, capacity=20)
    assert ix.pod_stats("n")["predicted"] == 16 and ix.pod_stats("e")["predicted"] == 16
    for k in prompts[2:]:
        clock.t += 1.0
        ix.record_route("n", k)  # the capacity is remembered
        ix.record_route("e", k, capacity=20)
    held = ix.pod_stats("n")["predicted"]
    assert 20 - 20 // 16 <= held <= 20 and ix.pod_stats("e")["predicted"] == 32
    assert ix.match(prompts[0])["n"].blocks == 0  # routed first: gone, as the pod evicted it
    assert ix.match(prompts[3])["n"].blocks == 8 and ix.match(prompts[0])["e"].blocks == 8
    assert ix.counters["blocks_evicted"] == 32 - held


def test_a_credit_repeated_within_a_sixteenth_of_the_ttl_keeps_the_first_expiry():
    """A follow-up credits its whole prefix again: keys credited less than TTL/16 ago stay where they
    are (expiring with the first credit), older ones move to the back with a new expiry, and new
    keys are added in order after them."""
    clock = Clock()
    clock.t = 0.0
    ix = PrefixIndex(block_size=BS, approximate_ttl_s=160.0, clock=clock)
    ix.add_pod("n", MODEL, approximate=True)
    t = toks(6)
    k = keys_of(t)
    ix.record_route("n", k[:2])       # expire at 160
    clock.t += 5.0
    ix.record_route("n", k[:4])       # 5 s < 160/16: the first two keep 160; two new ones expire at 165
    clock.t += 15.0
    ix.record_route("n", k[2:6])      # 15 s >= 10: the middle two move to 180; two new ones at 180
    assert ix.stats()["predicted_keys"] == 6
    clock.t = 161.0
    assert ix.match(k)["n"].blocks == 0  # the first two went at 160, so nothing leads
    assert ix.stats()["predicted_keys"] == 4
    clock.t = 170.0
    assert ix.match(k[2:])["n"].blocks == 4  # none of the rest expired at 165: all moved to 180
    clock.t = 181.0
    assert ix.match(k[2:])["n"].blocks == 0 and ix.stats()["predicted_keys"] == 0


def _refreshed(monkeypatch):
    """The keys each ChunkedOrder.refresh is handed, in order of calls."""
    seen: list[list[int]] = []
    real = bigmap.ChunkedOrder.refresh

    def spy(self, keys, *rest):
        seen.append(list(keys))
        return real(self, keys, *rest)
    monkeypatch.setattr(bigmap.ChunkedOrder, "refresh", spy)
    return seen


def test_a_follow_up_credits_only_past_its_credited_head_while_the_note_holds(monkeypatch):
    """A prompt credited whole leaves a note on its last key; the next turn of the conversation skips
    the keys before it without looking each up, for as long as the note vouches for them (credited
    within TTL/16: none of them expires sooner than 7/8 of a TTL from now)."""
    seen = _refreshed(monkeypatch)
    clock = Clock()
    ix = PrefixIndex(block_size=BS, approximate_ttl_s=160.0, clock=clock)
    ix.add_pod("n", MODEL, approximate=True)
    k = keys_of(toks(12))
    ix.record_route("n", k[:4])
    clock.t += 5.0
    ix.record_route("n", k[:8])                  # the turn after: only the new keys are handed on
    assert seen == [k[:4], k[4:8]]
    clock.t += 5.0                                # 10 s since the first four were credited: still fresh
    for _ in ix.credit_steps("n", k, None, piece=3):
        pass
    assert seen[2:] == [k[8:11], k[11:]]          # the head skipped, the rest a piece a step
    clock.t += 11.0                               # 21 s: past 160/16 since the head was looked at
    ix.record_route("n", k)
    assert seen[-1] == k                          # the note no longer vouches: every key looked up
    assert ix.match(k)["n"].blocks == 12
    assert all(ix._pods["n"].primary.pred.get(x) >= clock.t + 160.0 * 7 / 8 for x in k)


@pytest.mark.parametrize("first", [[2], [2, 0]], ids=["head new", "head known"])
def test_a_note_does_not_vouch_for_a_head_that_lost_a_key(monkeypatch, first):
    """A key evicted from the middle of a credited run (it kept an older place: it was fresh when
    the run was credited) leaves a hole that the bisection can step over; the note's oldest chunk
    is gone by then, so the next turn looks every key up and credits the hole again."""
    monkeypatch.setattr(bigmap, "CHUNK", 4)
    ix = PrefixIndex(block_size=BS, clock=Clock())
    ix.add_pod("n", MODEL, approximate=True)
    src = ix._pods["n"].primary
    k = keys_of(toks(9))
    ix.record_route("n", [k[i] for i in first])   # k2 first: the oldest entry (k0 after it, or not yet)
    ix.record_route("n", [1, 2, 3, 4])   # its chunk full and one more: the prompt starts in a later chunk
    ix.record_route("n", k[:8])       # k2 fresh, kept in the oldest chunk; the note on k7
    src.pred.pop_oldest(1, ix._pred, src.bit)   # evicts k2 alone (as the cap would)
    assert k[2] not in src.pred and ix.match(k)["n"].blocks == 8   # the bisection steps over the hole
    seen = _refreshed(monkeypatch)
    ix.record_route("n", k)
    assert seen == [k] and k[2] in src.pred


def test_no_note_for_a_prompt_whose_credit_a_cache_reset_cut_in_two():
    ix = PrefixIndex(block_size=BS, clock=Clock())
    ix.add_pod("n", MODEL, approximate=True)
    k = keys_of(toks(6))
    steps = ix.credit_steps("n", k, None, piece=2)
    next(steps)                      # the first two credited
    ix.clear_pod("n")                # the engine restarted: they are gone
    for _ in steps:
        pass                         # the other four credited after it
    src = ix._pods["n"].primary
    assert src.pred.present(k) == k[2:] and not src.spans


TTL = 64.0
credit_op = st.one_of(
    st.tuples(st.just("credit"), st.integers(0, 2), st.integers(0, 3), st.integers(1, 8)),
    st.tuples(st.just("tick"), st.sampled_from([0.0, TTL / 64, TTL / 24, TTL / 12, TTL / 3, TTL])),
    st.tuples(st.just("evict"), st.integers(1, 3)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(credit_op, max_size=40), st.sampled_from([4096, 1, 3]), st.sampled_from([0, 2]))
def test_after_a_credit_every_key_is_there_with_seven_eighths_of_a_ttl_or_more(ops, chunk, piece):
    """Whatever came before (follow-ups, partial repeats, expiry, evictions from the front), a credit
    that evicted nothing leaves each of its keys credited, expiring no sooner than 7/8 of a TTL on."""
    docs = [[(d + 1) * 1000 + i for i in range(8)] for d in range(3)]
    with mock.patch.object(bigmap, "CHUNK", chunk):
        clock = Clock()
        ix = PrefixIndex(block_size=BS, approximate_ttl_s=TTL, max_blocks_per_pod=10, clock=clock)
        ix.add_pod("n", MODEL, approximate=True)
        src = ix._pods["n"].primary
        for o in ops:
            if o[0] == "tick":
                clock.t += o[1]
            elif o[0] == "evict":
                src.pred.pop_oldest(o[1], ix._pred, src.bit)
            else:
                _, d, start, end = o
                keys = docs[d][start:max(start + 1, end)]
                evicted = ix.counters["blocks_evicted"]
                for _ in ix.credit_steps("n", keys, None, piece):
                    pass
                if ix.counters["blocks_evicted"] == evicted:
                    assert src.pred.present(keys) == keys
                    assert all(src.pred.get(x) >= clock.t + TTL * 7 / 8 for x in keys)


def test_match_restricted_to_some_pods_includes_unknown_ones_as_zero():
    ix = new_index()
    t = toks(2)
    ix.apply_event("a", stored([1, 2], None, t))
    ix.apply_event("b", stored([1, 2], None, t))
    m = ix.match(keys_of(t), pods=["b", "zz"])
    assert set(m) == {"b", "zz"} and m["b"].blocks == 2 and m["zz"].blocks == 0


def test_many_pods_bitmask_beyond_64():
    ix = PrefixIndex(block_size=BS)
    t = toks(8)
    k = keys_of(t)
    for i in range(100):
        ix.add_pod(f"p{i}", MODEL)
        n = i % 9
        if n:
            ix.apply_event(f"p{i}", stored(range(1, n + 1), None, t[: n * BS]))
    m = ix.match(k)
    assert all(m[f"p{i}"].blocks == i % 9 for i in range(100))


# --- property test -------------------------------------------------------------------------------
DOCS = [list(range(d * 1000, d * 1000 + 6 * BS)) for d in range(3)]
PODS = ["a", "b"]


def ehash(pod, rank, doc, i):
    return hash(("engine", pod, rank, doc, i)) & (2**64 - 1)


op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(PODS), st.integers(0, 1), st.integers(0, 2), st.integers(0, 5),
              st.integers(1, 3), st.sampled_from(["GPU", "CPU"])),
    st.tuples(st.just("remove"), st.sampled_from(PODS), st.integers(0, 1), st.integers(0, 2), st.integers(0, 5),
              st.sampled_from(["GPU", "CPU"])),
    st.tuples(st.just("clear"), st.sampled_from(PODS), st.integers(0, 1)),
    st.tuples(st.just("restart"), st.sampled_from(PODS)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40), st.integers(0, 2), st.sampled_from([4096, 1, 3]))
def test_index_agrees_with_a_brute_force_model(ops, query_doc, chunk):
    with mock.patch.object(bigmap, "CHUNK", chunk):  # tiny chunks: every order crosses chunk boundaries
        ix = PrefixIndex(block_size=BS, tier_weights={"GPU": 1.0, "CPU": 0.5})
        for p in PODS:
            ix.add_pod(p, MODEL)
        # model: (pod, rank) -> {(doc, i): {tier: physical copies}}; each store is one more copy (vLLM
        # announces every block that computed a hash) and each removal one copy fewer
        model: dict[tuple[str, int], dict[tuple[int, int], dict[str, int]]] = {(p, r): {} for p in PODS for r in (0, 1)}
        for o in ops:
            if o[0] == "store":
                _, p, r, d, start, n, tier = o
                n = min(n, 6 - start)
                held = model[(p, r)]
                parent_known = start == 0 or (d, start - 1) in held
                ev = stored([ehash(p, r, d, i) for i in range(start, start + n)],
                            None if start == 0 else ehash(p, r, d, start - 1),
                            DOCS[d][start * BS:(start + n) * BS], medium=tier)
                ix.apply_event(p, ev, dp_rank=r)
                if parent_known:
                    for i in range(start, start + n):
                        copies = held.setdefault((d, i), {})
                        copies[tier] = copies.get(tier, 0) + 1
            elif o[0] == "remove":
                _, p, r, d, i, tier = o
                ix.apply_event(p, BlockRemoved(block_hashes=[ehash(p, r, d, i)], medium=tier), dp_rank=r)
                held = model[(p, r)]
                if tier in held.get((d, i), {}):
                    copies = held[(d, i)]
                    copies[tier] -= 1
                    if not copies[tier]:
                        del copies[tier]
                    if not copies:
                        del held[(d, i)]
            elif o[0] == "clear":
                _, p, r = o
                ix.apply_event(p, AllBlocksCleared(), dp_rank=r)
                model[(p, r)] = {}
            else:
                _, p = o
                ix.clear_pod(p)
                model[(p, 0)], model[(p, 1)] = {}, {}
        keys = prompt_keys(DOCS[query_doc], BS, MODEL)
        got = ix.match(keys)
        for p in PODS:
            best_total, best = 0, None
            for r in (0, 1):
                held = model[(p, r)]

                def lead(pred, held=held):
                    n = 0
                    while n < 6 and (query_doc, n) in held and pred(held[(query_doc, n)]):
                        n += 1
                    return n
                total = lead(lambda s: True)
                gpu = lead(lambda s: "GPU" in s)
                cpu = lead(lambda s: "CPU" in s)
                weighted = gpu * 1.0 + (total - gpu) * 0.5
                if total > best_total:
                    best_total, best = total, (gpu, cpu, weighted)
            assert got[p].blocks == best_total, (p, got[p], model)
            if best:
                assert got[p].by_tier.get("GPU", 0) == best[0] and got[p].by_tier.get("CPU", 0) == best[1]
                assert abs(got[p].weighted - best[2]) < 1e-9
        # engine-hash maps agree with the model too
        for (p, r), held in model.items():
            expect = {prompt_keys(DOCS[d][: (i + 1) * BS], BS, MODEL)[-1] for (d, i) in held}
            assert ix.blocks_of(p, r) == expect


def test_long_prompts_across_walk_chunk_boundaries_match_brute_force():
    n = 400
    t = toks(n)
    k = keys_of(t)
    depths = [0, 1, 15, 16, 17, 79, 80, 81, 335, 336, 337, 399, 400]
    ix = PrefixIndex(block_size=BS)
    for i, depth in enumerate(depths):
        ix.add_pod(f"p{i}", MODEL)
        if depth:
            ix.apply_event(f"p{i}", stored(range(1, depth + 1), None, t[: depth * BS]))
    # a pod with a hole at block 200 and everything else
    ix.add_pod("holey", MODEL)
    ix.apply_event("holey", stored(range(1, n + 1), None, t))
    ix.apply_event("holey", BlockRemoved(block_hashes=[201], medium="GPU"))
    m = ix.match(k)
    assert [m[f"p{i}"].blocks for i in range(len(depths))] == depths
    assert m["holey"].blocks == 200
    assert ix.match(k[:16])["p3"].blocks == 16 and ix.match(k[:17])["p4"].blocks == 17
    ix.speculate("p0", k[:90])
    assert ix.match(k)["p0"].blocks == 90


def test_past_the_cap_at_most_a_batch_goes_at_once(monkeypatch):
    """One eviction is one stall of the event loop: a sixteenth of a 1M-block cap is 62,500 entries
    (tens of ms). Past the cap, the oldest go a batch at a time (``EVICT_BATCH``), for confirmed
    blocks, predicted ones and the recency map alike. Here a batch of 3 against a sixteenth of 10."""
    import indexer.index as index_mod
    import indexer.recency as recency_mod

    monkeypatch.setattr(index_mod, "EVICT_BATCH", 3)
    monkeypatch.setattr(recency_mod, "EVICT_BATCH", 3)
    ix = new_index(max_blocks_per_pod=160)
    ix.add_pod("n", MODEL, approximate=True)
    k = keys_of(toks(161))
    ix.record_route("n", k)  # one over the cap: down to 157, the four oldest gone
    assert ix.pod_stats("n")["predicted"] == 157 and ix.counters["blocks_evicted"] == 4
    assert ix.match(k[4:])["n"].blocks == 157
    t = toks(161, base=5000)
    for i in range(161):
        ix.apply_event("a", stored([i], None if i == 0 else i - 1, t[i * BS:(i + 1) * BS]))
    held = ix.blocks_of("a")
    assert len(held) == 157 and keys_of(t)[3] not in held and keys_of(t)[4] in held
    rec = BlockRecency(Clock(), max_blocks_per_pod=160)
    rec.release("a", list(range(161)))
    assert rec.stats("a")["blocks"] == 157
