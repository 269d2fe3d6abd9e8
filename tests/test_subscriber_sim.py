"""End to end with the simulated pod: its real KV events, over ZMQ, into the index."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import zmq.asyncio

from indexer.index import PrefixIndex
from indexer.keys import prompt_keys
from indexer.subscriber import KVEventSubscriber
from indexer.tokens import RemoteTokenizer
from tests.helpers import ROOT, free_ports, kvroute_process

MODEL = "sim-model"
BS = 16


async def until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_sim_events_feed_the_index_through_reset_gap_and_restart():
    http, ev, rep = free_ports(3)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
           "replay_endpoint": f"tcp://*:{rep}", "topic": f"kv@pod-0@{MODEL}"}
    args = ["sim", "--port", str(http), "--host", "127.0.0.1", "--block-size", str(BS),
            "--kv-events-config", json.dumps(cfg)]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{http}/health"):
        ctx = zmq.asyncio.Context()
        ix = PrefixIndex(block_size=BS)
        sub = KVEventSubscriber(ix, context=ctx, replay_timeout_s=2.0, reconnect_min_s=0.05)
        sub.add_endpoint("pod-0", f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rep}", topic="kv@", model=MODEL)
        await sub.start()
        base = f"http://127.0.0.1:{http}"
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                tok = RemoteTokenizer(base, MODEL, client)

                async def complete(prompt):
                    r = await client.post(f"{base}/v1/completions",
                                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
                    assert r.status_code == 200, r.text

                async def held(prompt):
                    keys = prompt_keys(await tok.encode(prompt), BS, MODEL)
                    return ix.match(keys)["pod-0"].blocks, len(keys)

                def stats():
                    return sub.stats()[f"pod-0@tcp://127.0.0.1:{ev}"]

                # the SUB may join after the first batch: catch-up or the next batch repairs it
                p1 = "The quick brown fox jumps over the lazy dog. " * 8
                deadline = time.monotonic() + 10
                while stats()["batches"] == 0:
                    await complete(f"warm-up {time.monotonic()}")
                    await asyncio.sleep(0.05)
                    assert time.monotonic() < deadline
                await complete(p1)
                n = (await held(p1))[1]
                await until(lambda: ix.match(prompt_keys(list(p1.encode()), BS, MODEL))["pod-0"].blocks == n)
                assert (await held(p1)) == (n, n)

                # reset_prefix_cache -> AllBlocksCleared
                assert (await client.post(f"{base}/reset_prefix_cache")).status_code == 200
                await until(lambda: ix.pod_stats("pod-0")["blocks"] == 0)

                # events lost on the wire (still buffered): the gap is repaired by replay
                gaps0 = stats()["gaps"]
                await client.post(f"{base}/sim/faults", json={"events_stop": True})
                p2 = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 6
                await complete(p2)
                await client.post(f"{base}/sim/faults", json={"events_stop": False})
                p3 = "A third prompt that arrives after the events resume. " * 4
                await complete(p3)
                n2 = (await held(p2))[1]
                await until(lambda: ix.match(prompt_keys(list(p2.encode()), BS, MODEL))["pod-0"].blocks == n2)
                assert stats()["gaps"] == gaps0 + 1 and stats()["lost_batches"] == 0

                # the engine's event stream restarts (seq back to 0, cache forgotten)
                await client.post(f"{base}/sim/faults", json={"events_restart": True})
                p4 = "After the restart only this prompt is cached on the pod. " * 4
                await complete(p4)
                n4 = (await held(p4))[1]
                await until(lambda: ix.match(prompt_keys(list(p4.encode()), BS, MODEL))["pod-0"].blocks == n4)
                assert (await held(p2))[0] == 0 and stats()["restarts"] >= 1
                assert stats()["decode_errors"] == 0
        finally:
            await sub.stop()
            ctx.destroy(linger=0)


def test_kvroute_events_prints_the_sims_stream():
    http, ev, rep = free_ports(3)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
           "replay_endpoint": f"tcp://*:{rep}", "topic": f"kv@pod-0@{MODEL}"}
    args = ["sim", "--port", str(http), "--host", "127.0.0.1", "--block-size", str(BS),
            "--kv-events-config", json.dumps(cfg)]
    with kvroute_process(args, ready_url=f"http://127.0.0.1:{http}/health"):
        prompt = "x" * 40
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions",
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=10)
        assert r.status_code == 200
        out = subprocess.run([sys.executable, "-m", "router.cli", "events", f"tcp://127.0.0.1:{ev}",
                              "--replay", f"tcp://127.0.0.1:{rep}", "--from-seq", "0", "--count", "1",
                              "--timeout", "5"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.splitlines()[0])
    assert line["seq"] == 0 and line["topic"] == f"kv@pod-0@{MODEL}" and line["source"] == "replay"
    stored = line["events"][0]
    assert stored["type"] == "BlockStored" and stored["block_size"] == BS
    assert stored["token_ids"][:BS * 2] == list(prompt.encode())[:BS * 2]
