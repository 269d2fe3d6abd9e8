"""KV events from a simulated pod, read with plain pyzmq and decoded by the spec (no kvroute decoder)."""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import pytest
import zmq

from simulator.testing import consecutive_free_ports
from tests.helpers import kvroute_process

BLOCK = 4


def start_sim(fmt: str, blocks: int = 8):
    base = consecutive_free_ports(3)
    http, pub = base, base + 1
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
           "replay_endpoint": f"tcp://*:{pub + 1}", "topic": "kv@pod-a@sim-model", "buffer_steps": 100}
    proc = kvroute_process(["sim", "--enable-prompt-tokens-details",
                            "--port", str(http), "--block-size", str(BLOCK), "--num-gpu-blocks", str(blocks),
                            "--kv-events-config", json.dumps(cfg), "--kv-events-format", fmt],
                           ready_url=f"http://127.0.0.1:{http}/health")
    return proc, f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{pub + 1}"


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 2000)
    sub.connect(endpoint)
    time.sleep(0.3)  # slow-joiner: let the subscription reach the publisher
    return sub


def recv_batches(sub: zmq.Socket, until) -> list[tuple[bytes, int, list]]:
    """Frames -> (topic, seq, decoded payload) until ``until(batches)`` holds (2 s per frame at most)."""
    out = []
    while not until(out):
        frames = sub.recv_multipart()
        assert len(frames) == 3
        topic, seq, payload = frames
        assert len(seq) == 8
        out.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return out


def event_kind(ev) -> str:
    return ev["type"] if isinstance(ev, dict) else ev[0]


def stored_fields(ev) -> dict:
    """BlockStored fields by name: from a map, or by the spec's positions from a legacy array."""
    if isinstance(ev, dict):
        return ev
    names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
    return dict(zip(names, ev[1:]))


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_events_follow_the_wire_spec(fmt):
    ctx = zmq.Context()
    proc, http, pub, _ = start_sim(fmt)
    try:
        with proc:
            sub = subscribe(ctx, pub)
            prompt = list(range(10, 22))  # 12 tokens = 3 blocks of 4
            httpx.post(http + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            batches = recv_batches(sub, lambda b: any(event_kind(e) == "BlockStored" for _, _, p in b for e in p[1]))
            topic, seq, payload = batches[0]
            assert topic == b"kv@pod-a@sim-model" and seq == 0
            assert isinstance(payload, list) and len(payload) == 3  # [ts, events, dp_rank]
            ts, events, dp_rank = payload
            assert isinstance(ts, float) and abs(ts - time.time()) < 30 and dp_rank == 0
            ev = events[0]
            if fmt == "map":
                assert isinstance(ev, dict) and ev["type"] == "BlockStored"
                assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name"} <= set(ev)
                assert ev["group_idx"] == 0 and ev["kv_cache_spec_kind"] == "full_attention"
            else:
                assert isinstance(ev, list) and ev[0] == "BlockStored" and len(ev) == 10
            f = stored_fields(ev)
            assert f["token_ids"] == prompt and f["block_size"] == BLOCK and f["medium"] == "GPU"
            assert f["parent_block_hash"] is None and len(f["block_hashes"]) == 3
            assert all(0 <= h < 2**64 for h in f["block_hashes"])
            first_hashes = f["block_hashes"]

            # a second prompt sharing the first 2 blocks: only the new block is announced, chained to block 2
            httpx.post(http + "/v1/completions", json={"prompt": prompt[:8] + [99] * 8, "max_tokens": 1})
            more = recv_batches(sub, lambda b: any(event_kind(e) == "BlockStored" for _, _, p in b for e in p[1]))
            stored = [stored_fields(e) for _, _, p in more for e in p[1] if event_kind(e) == "BlockStored"]
            assert stored[0]["parent_block_hash"] == first_hashes[1]
            assert stored[0]["token_ids"] == [99] * 8
            assert [s for _, s, _ in batches + more] == list(range(len(batches) + len(more)))

            # filling the 8-block cache evicts unreferenced blocks: BlockRemoved, then reset: AllBlocksCleared
            httpx.post(http + "/v1/completions", json={"prompt": list(range(500, 528)), "max_tokens": 1})
            httpx.post(http + "/reset_prefix_cache")
            rest = recv_batches(sub, lambda b: any(event_kind(e) == "AllBlocksCleared" for _, _, p in b for e in p[1]))
            kinds = [event_kind(e) for _, _, p in rest for e in p[1]]
            assert "BlockRemoved" in kinds and kinds[-1] == "AllBlocksCleared"
            removed = next(e for _, _, p in rest for e in p[1] if event_kind(e) == "BlockRemoved")
            if fmt == "map":
                assert removed["medium"] == "GPU" and len(removed["block_hashes"]) == 1
            else:
                assert removed[2] == "GPU" and len(removed[1]) == 1
            cleared = next(e for _, _, p in rest for e in p[1] if event_kind(e) == "AllBlocksCleared")
            assert cleared == ({"type": "AllBlocksCleared"} if fmt == "map" else ["AllBlocksCleared"])
    finally:
        ctx.destroy(0)


def test_dealer_replay_with_end_marker_and_seq_restart():
    ctx = zmq.Context()
    proc, http, pub, replay = start_sim("map", blocks=64)
    try:
        with proc:
            for i in range(4):
                httpx.post(http + "/v1/completions", json={"prompt": [i] * 8, "max_tokens": 1})
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVTIMEO, 2000)
            dealer.connect(replay)

            def replay_from(start: int) -> list[list[bytes]]:
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                got = []
                while True:
                    frames = dealer.recv_multipart()
                    got.append(frames)
                    if frames[-1] == b"":
                        return got

            got = replay_from(1)
            *batches, end = got
            assert end == [b"", b"", b"\xff" * 8, b""]
            assert [int.from_bytes(f[2], "big") for f in batches] == [1, 2, 3]
            for frames in batches:
                assert len(frames) == 4 and frames[0] == b"" and frames[1] == b"kv@pod-a@sim-model"
                ts, events, rank = msgspec.msgpack.decode(frames[3])
                assert events[0]["type"] == "BlockStored"

            # fault: the sequence restarts at 0 (as after an engine restart) and the old buffer is gone
            sub = subscribe(ctx, pub)
            r = httpx.post(http + "/sim/faults", json={"events_restart": True})
            assert r.status_code == 200
            httpx.post(http + "/v1/completions", json={"prompt": [7] * 8, "max_tokens": 1})
            (topic, seq, payload), = recv_batches(sub, lambda b: len(b) >= 1)
            assert seq == 0
            assert payload[1][0]["token_ids"] == [7] * 8  # the restarted engine had forgotten its cache
            got = replay_from(0)
            assert [int.from_bytes(f[2], "big") for f in got[:-1]] == [0]

            # fault: events stop (batches are lost, not published), then resume: the gap is visible
            httpx.post(http + "/sim/faults", json={"events_stop": True})
            httpx.post(http + "/v1/completions", json={"prompt": [8] * 8, "max_tokens": 1})
            with pytest.raises(zmq.Again):
                sub.setsockopt(zmq.RCVTIMEO, 500)
                sub.recv_multipart()
            httpx.post(http + "/sim/faults", json={"events_stop": False})
            httpx.post(http + "/v1/completions", json={"prompt": [9] * 8, "max_tokens": 1})
            sub.setsockopt(zmq.RCVTIMEO, 2000)
            (_, seq, _), = recv_batches(sub, lambda b: len(b) >= 1)
            assert seq == 2  # seq 1 was lost on the wire but can be replayed
            assert [int.from_bytes(f[2], "big") for f in replay_from(1)[:-1]] == [1, 2]
    finally:
        ctx.destroy(0)


def test_kv_events_port_shortcut_offsets_per_pod():
    base = consecutive_free_ports(6)
    http, ev = base, base + 2
    ctx = zmq.Context()
    try:
        with kvroute_process(["sim", "--enable-prompt-tokens-details",
                              "--port", str(http), "--count", "2", "--kv-events-port", str(ev)],
                             ready_url=f"http://127.0.0.1:{http + 1}/health"):
            state = httpx.get(f"http://127.0.0.1:{http + 1}/sim/state").json()
            assert state["events"]["endpoint"] == f"tcp://*:{ev + 2}"
            assert state["events"]["replay_endpoint"] == f"tcp://*:{ev + 3}"
            assert state["events"]["topic"] == f"kv@127.0.0.1:{http + 1}@sim-model"
            sub = subscribe(ctx, f"tcp://127.0.0.1:{ev + 2}")
            httpx.post(f"http://127.0.0.1:{http + 1}/v1/completions", json={"prompt": "x" * 40, "max_tokens": 1})
            (topic, seq, payload), = recv_batches(sub, lambda b: len(b) >= 1)
            assert topic == f"kv@127.0.0.1:{http + 1}@sim-model".encode()
    finally:
        ctx.destroy(0)


def test_bad_kv_events_config_is_refused():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "router.cli", "sim",
                        "--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}'],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "bogus" in r.stderr


def test_a_data_parallel_pod_runs_one_engine_per_rank_as_vllm_does():
    """``--data-parallel-size 2``: rank r publishes on the event port + r (replay from + 2), every batch
    naming its rank; ``X-data-parallel-rank`` sends a request to that engine, whose cache is its own
    (the same prompt hits on rank 1 and misses on rank 0); without the header the balancer spreads
    idle requests over both, cache or not; /metrics shows both engines under one family header."""
    base = consecutive_free_ports(5)
    http, ev = base, base + 1
    url = f"http://127.0.0.1:{http}"
    ctx = zmq.Context()
    try:
        with kvroute_process(["sim", "--enable-prompt-tokens-details",
                              "--port", str(http), "--data-parallel-size", "2", "--kv-events-port", str(ev),
                              "--block-size", "16", "--timing", "seed"], ready_url=url + "/health"), \
                httpx.Client(base_url=url, timeout=10) as c:
            subs = [subscribe(ctx, f"tcp://127.0.0.1:{ev + r}") for r in range(2)]
            prompt = {"model": "sim-model", "prompt": "a data parallel prompt " * 8, "max_tokens": 1}

            def cached(rank: int | None) -> int:
                headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
                r = c.post("/v1/completions", json=prompt, headers=headers)
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            assert cached(1) == 0
            (_, _, payload), = recv_batches(subs[1], lambda b: len(b) >= 1)
            assert payload[2] == 1 and event_kind(payload[1][0]) == "BlockStored"   # [ts, events, rank]
            with pytest.raises(zmq.Again):
                subs[0].recv_multipart()   # rank 0 stored nothing
            assert cached(1) > 0 and cached(0) == 0
            (_, _, payload), = recv_batches(subs[0], lambda b: len(b) >= 1)
            assert payload[2] == 0

            # no header: vLLM's balancer, blind to the cache, alternates between idle engines
            prompt = {"model": "sim-model", "prompt": "another prompt entirely " * 8, "max_tokens": 1}
            hits = [cached(None) for _ in range(4)]
            assert hits.count(0) == 2 and all(h > 0 for h in hits[2:]), hits

            assert c.post("/v1/completions", json=prompt, headers={"X-data-parallel-rank": "2"}).json() == {
                "error": {"message": "data_parallel_rank 2 is out of range [0, 2).", "type": "BadRequestError",
                          "param": None, "code": 400}}
            assert c.post("/v1/completions", json=prompt, headers={"X-data-parallel-rank": "x"}).status_code == 200
            text = c.get("/metrics").text
            assert text.count("# TYPE vllm:num_requests_running gauge") == 1
            assert 'engine="0"' in text and 'engine="1"' in text
            for s in subs:
                s.close()
    finally:
        ctx.destroy(0)
