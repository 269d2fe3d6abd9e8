"""Pure pieces of the simulator: event bytes against the spec's examples, the block pool, config."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.block_pool import BlockPool
from simulator.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    KVEventsConfigError,
    LegacyAllBlocksCleared,
    LegacyBlockRemoved,
    LegacyBlockStored,
    block_stored,
    encode_batch,
)
from simulator.hashing import BlockHasher, cbor, external


def test_legacy_array_bytes_match_the_spec_example():
    # spec 1.3: [1.5, [["BlockStored",[11,12],nil,[1,2,3,4],2,nil,"GPU",nil,nil,0], ["BlockRemoved",[11],"GPU",nil],
    #               ["AllBlocksCleared"]], 0]; hex starts 93 cb3ff8000000000000 93 9a ab"BlockStored" 92 0b 0c c0
    batch = KVEventBatch(1.5, [LegacyBlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 0),
                               LegacyBlockRemoved([11], "GPU", None), LegacyAllBlocksCleared()], 0)
    raw = msgspec.msgpack.encode(batch)
    assert raw.startswith(bytes.fromhex("93cb3ff8000000000000939aab") + b"BlockStored" + bytes.fromhex("920b0cc0"))
    assert msgspec.msgpack.decode(raw) == [1.5, [["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU", None,
                                                  None, 0], ["BlockRemoved", [11], "GPU", None],
                                                 ["AllBlocksCleared"]], 0]


def test_map_form_matches_the_v026_capture():
    h = 15760518052499183552  # >= 2^63: must go out as msgpack uint64 (0xcf)
    ev = BlockStored([h], None, list(range(16)), 16, None, "GPU", None, extra_keys=[None], group_idx=0,
                     kv_cache_spec_kind="full_attention")
    raw = encode_batch(1789095808.83, [ev, BlockRemoved([h], "GPU", group_idx=0), AllBlocksCleared()], 0)
    assert bytes.fromhex("cf") + h.to_bytes(8, "big") in raw
    ts, events, rank = msgspec.msgpack.decode(raw)
    assert (ts, rank) == (1789095808.83, 0)
    assert events[0] == {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                         "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
                         "lora_name": None, "extra_keys": [None], "group_idx": 0,
                         "kv_cache_spec_kind": "full_attention"}
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_hash_chain_is_deterministic_and_chained():
    hasher = BlockHasher("sha256")
    tokens = list(range(40))
    d = hasher.chain(None, tokens, 16)
    assert len(d) == 2 and d == BlockHasher("sha256").chain(None, tokens, 16)  # the fixed default seed
    assert hasher.chain(d[0], tokens[16:], 16) == [d[1]]
    assert BlockHasher("sha256", "other").chain(None, tokens, 16)[0] != d[0]
    assert BlockHasher("sha256_cbor").chain(None, tokens, 16)[0] != d[0]
    assert 0 <= external(d[0]) < 2**64 and external(d[0]) == int.from_bytes(d[0][-8:], "big")
    # a salt keys the first block only, yet the whole chain differs; an adapter keys every block
    salted = hasher.chain(None, tokens, 16, first_keys=(("cache_salt", "a"),))
    assert salted[0] != d[0] and salted[1] != d[1]
    assert hasher.chain(salted[0], tokens[16:], 16) == [salted[1]]
    adapter = hasher.chain(d[0], tokens[16:], 16, every_keys=(("lora", "x", "/x"),))
    assert adapter != [d[1]]


def test_hash_seeds_resolve_as_vllm_resolves_them(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert BlockHasher("sha256").seed == BlockHasher("sha256_cbor").seed == "vllm-none-hash"
    # xxhash is not collision resistant: a random secret seed per engine unless one is given
    a, b = BlockHasher("xxhash"), BlockHasher("xxhash_cbor")
    assert a.seed != b.seed and len(a.seed) == 64 and a.chain(None, [1] * 16, 16) != BlockHasher("xxhash").chain(
        None, [1] * 16, 16)
    assert len(a.root) == 16  # XXH3-128
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert BlockHasher("xxhash").seed == BlockHasher("sha256").seed == "42"
    assert BlockHasher("xxhash").chain(None, [1] * 16, 16) == BlockHasher("xxhash").chain(None, [1] * 16, 16)
    assert BlockHasher("sha256", "7").seed == "7"
    with pytest.raises(ValueError, match="unknown prefix caching hash algorithm 'md5'"):
        BlockHasher("md5")


def test_cbor_is_canonical_as_rfc_8949_shows():
    """Examples from RFC 8949, appendix A (what vLLM's sha256_cbor hashes is this encoding)."""
    cases = [(0, "00"), (23, "17"), (24, "1818"), (1000, "1903e8"), (1000000, "1a000f4240"),
             (18446744073709551615, "1bffffffffffffffff"), (-1, "20"), (-1000, "3903e7"), (None, "f6"),
             (False, "f4"), (True, "f5"), (b"\x01\x02\x03\x04", "4401020304"), ("IETF", "6449455446"),
             ("\u00fc", "62c3bc"), ((), "80"), ((1, (2, 3), [4, 5]), "8301820203820405"),
             (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819")]
    for value, hexed in cases:
        assert cbor(value).hex() == hexed, value
    with pytest.raises(TypeError):
        cbor(1.5)


def test_an_adapters_and_a_salts_blocks_are_announced_as_vllm_announces_them():
    """vLLM's BlockStored for a LoRA request: lora_id and lora_name, and untagged extra keys per block
    (the adapter's name on each, then the salt on a prompt's first block); a run that continues a
    chain (has a parent) carries no salt."""
    got: list[tuple] = []
    pool = BlockPool(8, 2, got.append)
    lora = (1, "sql", "/adapters/sql")
    pool.cache(pool.allocate(2) or [], [11, 12], None, [1, 2, 3, 4], salt="s", lora=lora)
    pool.cache(pool.allocate(1) or [], [13], 12, [5, 6], salt="s", lora=lora)
    pool.cache(pool.allocate(1) or [], [14], None, [7, 8], salt="s")
    pool.cache(pool.allocate(1) or [], [15], None, [9, 10])
    assert got == [("stored", [11, 12], None, [1, 2, 3, 4], [["sql", "s"], ["sql"]], lora),
                   ("stored", [13], 12, [5, 6], [["sql"]], lora),
                   ("stored", [14], None, [7, 8], [["s"]], None),
                   ("stored", [15], None, [9, 10])]
    ev = block_stored("map", [11, 12], None, [1, 2, 3, 4], 2, extra_keys=got[0][4], lora=lora)
    assert (ev.lora_id, ev.lora_name, ev.extra_keys) == (1, "sql", [["sql", "s"], ["sql"]])


def test_block_pool_lru_eviction_and_refcounts():
    events = []
    pool = BlockPool(4, 2, events.append)
    a = pool.allocate(2)
    pool.cache(a, [101, 102], None, [1, 2, 3, 4])
    assert events[-1] == ("stored", [101, 102], None, [1, 2, 3, 4])
    assert pool.usage() == 0.5
    pool.release(a)
    assert pool.usage() == 0.0 and pool.match_prefix([101, 102, 103]) == a
    pool.touch(pool.match_prefix([101]))  # in use again: cannot be evicted
    b = pool.allocate(3)  # 2 never-used blocks, then the LRU freed one: block of hash 102 (freed tail-first)
    assert b is not None and ("removed", [102]) in events and ("removed", [101]) not in events
    assert pool.allocate(1) is None  # 101 is referenced
    pool.reset()
    assert events[-1] == ("cleared",) and pool.match_prefix([101]) == []


def test_a_prompt_computed_twice_at_once_leaves_two_announced_copies_evicted_one_by_one():
    events: list = []
    pool = BlockPool(4, 2, events.append)
    a, b = pool.allocate(2), pool.allocate(2)      # two requests, one prompt, neither cached yet
    pool.cache(a, [101, 102], None, [1, 2, 3, 4])
    pool.cache(b, [101, 102], None, [1, 2, 3, 4])
    assert events == [("stored", [101, 102], None, [1, 2, 3, 4])] * 2   # as vLLM: every copy announced
    assert pool.match_prefix([101, 102]) == a
    pool.release(a)
    pool.release(b)
    pool.allocate(1)                               # evicts a's last block: one copy of 102 goes
    assert events[-1] == ("removed", [102]) and len(pool.match_prefix([101, 102])) == 2
    pool.allocate(3)                               # the rest: one BlockRemoved per copy
    assert events[-3:] == [("removed", [101]), ("removed", [102]), ("removed", [101])]
    assert pool.match_prefix([101]) == [] and pool.copies == {}


def test_a_freed_block_without_a_hash_is_reused_before_any_cached_block():
    events: list = []
    pool = BlockPool(4, 2, events.append)
    cached = pool.allocate(2)
    pool.cache(cached, [101, 102], None, [1, 2, 3, 4])
    pool.release(cached)
    for _ in range(5):                 # a one-block request over and over (its block is never full)
        partial = pool.allocate(1)
        pool.release(partial)
    assert events == [("stored", [101, 102], None, [1, 2, 3, 4])]   # vLLM: nothing cached was evicted
    assert pool.match_prefix([101, 102]) == cached


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["allocate", "cache", "touch", "release"]), st.integers(0, 9),
                          st.integers(0, 5)), max_size=60),
       st.lists(st.tuples(st.sampled_from(["allocate", "cache", "touch", "release"]), st.integers(0, 9),
                          st.integers(0, 5)), max_size=60))
def test_a_copied_pool_behaves_as_a_deep_copy_and_leaves_the_original_alone(before: list, after: list) -> None:
    """``BlockPool.copy`` (the oracle's forward runs) against a deep copy: the same operations give
    the same blocks, hashes, ref counts and free-queue order, and the original does not change."""
    import copy

    def apply(pool: BlockPool, ops: list, held: list[list[int]]) -> list:
        seen: list = []
        for op, a, b in ops:
            if op == "allocate":
                got = pool.allocate(a % 4)
                if got:
                    held.append(got)
                seen.append(got)
            elif op == "cache" and held:
                ids = held[a % len(held)]
                pool.cache(ids, [1000 * b + i for i in range(len(ids))], None, [0] * (2 * len(ids)))
            elif op == "touch":
                hit = pool.match_prefix([1000 * b + i for i in range(a % 4)])
                pool.touch(hit)
                held.append(hit)
                seen.append(hit)
            elif op == "release" and held:
                pool.release(held.pop(a % len(held)))
            seen.append((len(pool.free), pool.usage()))
        return seen

    pool = BlockPool(12, 2)
    held: list[list[int]] = []
    apply(pool, before, held)
    state = (list(pool.ref), list(pool.block_hash), list(pool.free), dict(pool.cached))
    deep, cheap = copy.deepcopy(pool), pool.copy()
    deep_held, cheap_held = copy.deepcopy(held), copy.deepcopy(held)
    assert apply(cheap, after, cheap_held) == apply(deep, after, deep_held)
    assert (cheap.ref, cheap.block_hash, cheap.cached) == (deep.ref, deep.block_hash, deep.cached)
    assert cheap.allocate(len(cheap.free)) == deep.allocate(len(deep.free))  # the same queue, in order
    assert (list(pool.ref), list(pool.block_hash), list(pool.free), dict(pool.cached)) == state


def test_kv_events_config_parsing_and_offsets():
    cfg = KVEventsConfig.from_json({"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                                    "topic": "kv@{pod}@{model}"})
    assert cfg.enabled
    pod2 = cfg.for_pod(2, "p2", "m")
    assert (pod2.endpoint, pod2.replay_endpoint, pod2.topic) == ("tcp://*:5561", "tcp://*:5562", "kv@p2@m")
    connect = KVEventsConfig.from_json({"enable_kv_cache_events": True, "endpoint": "tcp://indexer:5557"})
    assert connect.for_pod(3, "p", "m").endpoint == "tcp://indexer:5557"  # a connecting endpoint is shared
    assert not KVEventsConfig.from_json({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert not KVEventsConfig.from_json({}).enabled
    for bad in ({"publisher": "kafka"}, {"hwm": "many"}, {"extra": 1}, {"enable_kv_cache_events": 1}):
        with pytest.raises(KVEventsConfigError):
            KVEventsConfig.from_json(bad)


def test_every_setting_is_a_documented_flag_and_env_and_yaml_work(tmp_path, monkeypatch, capsys):
    from kvcommon.settings import load_settings
    from simulator.settings import SimSettings

    with pytest.raises(SystemExit):
        load_settings(SimSettings, ["--help"], prog="kvroute sim", description="")
    text = capsys.readouterr().out
    for name in SimSettings.model_fields:
        assert "--" + name.replace("_", "-") in text, name
        assert "KVROUTE_SIM_" + name.upper() in text.replace("\n", "").replace(" ", ""), name
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("block_size: 64\nnum_gpu_blocks: 3000\ntiming: seed\n")
    monkeypatch.setenv("KVROUTE_SIM_NUM_GPU_BLOCKS", "100")
    s = load_settings(SimSettings, ["--config", str(cfg), "--timing", "cost"], prog="x", description="")
    assert (s.block_size, s.num_gpu_blocks, s.timing) == (64, 100, "cost")  # yaml < env < flags
    with pytest.raises(SystemExit):
        load_settings(SimSettings, ["--kv-events-port", "5557", "--kv-events-config", "{}"], prog="x", description="")


def test_blocks_are_cached_when_scheduled_so_a_request_later_in_the_step_reuses_them():
    """vLLM 0.32 caches a request's blocks when it schedules them (``allocate_slots`` calls
    ``cache_blocks`` up to the computed plus the new tokens), before the step computes them: B, waiting
    behind A with the same prompt, finds A's last chunk cached in the step that computes it. Caching
    at the step's end instead made B compute that chunk again and take one more step."""
    from indexer.keys import block_keys
    from simulator.core import CostCore, CostParams
    from whatif.podmodel import ModelRequest

    events: list[tuple] = []
    pool = BlockPool(64, 16, events.append)
    hits: dict[int, int] = {}

    class Core(CostCore):
        def _on_admitted(self, req, hit_tokens, now):
            hits[req.index] = hit_tokens

    core = Core(pool, CostParams(block_size=16, max_num_batched_tokens=64))
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks, the last 4 tokens in a partial one
    a, b = (ModelRequest(i, prompt, block_keys(prompt, 16, 7), 1, 0.0) for i in (0, 1))
    core.submit(a)
    core.submit(b)
    first = core.schedule(0.0)
    assert [(r.index, n) for r, n in first] == [(0, 64)]  # A's first chunk takes the whole budget
    assert [h for _, hashes, *_ in events for h in hashes] == a.hashes[:4]  # cached as it is scheduled
    core.commit(first, 1.0, 1.0)
    second = core.schedule(1.0)
    # A's last 36 tokens, and B reuses all 6 of A's full blocks, the 2 just scheduled included
    assert [(r.index, n) for r, n in second] == [(0, 36), (1, 4)]
    assert hits == {0: 0, 1: 96}
    stored = [h for kind, hashes, *_ in events if kind == "stored" for h in hashes]
    assert stored == a.hashes[:6]  # announced once each, by the request that computes them
    core.commit(second, 2.0, 1.0)
    assert a.first_token_at == b.first_token_at == 2.0
