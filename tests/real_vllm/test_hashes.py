"""The simulator hashes blocks as vLLM does: the hashes a real engine publishes for a prompt (and for
the same prompt with a ``cache_salt``) equal the simulator's for the same tokens, and vLLM's own hash
functions, run in the real-vLLM venv, agree with the simulator's for every algorithm that venv has and
for a ``PYTHONHASHSEED``.

kvroute's router does not depend on these values (it keys its index from the events' token ids); a
peer or tool that reads engine hashes does, and the simulator must not mislead it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import httpx
import zmq

from indexer.events import BlockStored, decode_frame
from realvllm.engines import BLOCK_SIZE, MODEL_NAME
from simulator.hashing import BlockHasher, external


def stored_events(engine, body: dict, timeout: float = 60.0) -> list[BlockStored]:
    """Send ``body`` to the engine and collect the BlockStored events its answer caused (a SUB socket
    joined before the request: its first block's event has no parent)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{engine.events_port}")
    try:
        time.sleep(1.0)  # ZeroMQ's slow joiner: a SUB misses what is published while it connects
        r = httpx.post(engine.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        want = body["prompt"][:len(body["prompt"]) // BLOCK_SIZE * BLOCK_SIZE]
        got: list[BlockStored] = []
        deadline = time.monotonic() + timeout
        while sum(len(e.token_ids) for e in got) < len(want):
            assert time.monotonic() < deadline, f"no BlockStored for the prompt within {timeout:g}s"
            if not sub.poll(500):
                continue
            _, _, batch = decode_frame(sub.recv_multipart())
            for ev in batch.events:
                if isinstance(ev, BlockStored) and (got or ev.token_ids[:BLOCK_SIZE] == want[:BLOCK_SIZE]):
                    got.append(ev)
        return got
    finally:
        sub.close()


def test_the_engines_published_hashes_are_the_simulators(agg_engines):
    engine = agg_engines[0]
    rng = random.Random(os.getpid() ^ time.time_ns())
    prompt = [rng.randrange(100, 2000) for _ in range(3 * BLOCK_SIZE + 5)]
    # the engines run vLLM's default algorithm (sha256) with the PYTHONHASHSEED realvllm gives them
    hasher = BlockHasher("sha256", engine.environment()["PYTHONHASHSEED"])

    plain = stored_events(engine, {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert plain[0].parent_block_hash is None
    tokens = [t for e in plain for t in e.token_ids]
    assert tokens[:3 * BLOCK_SIZE] == prompt[:3 * BLOCK_SIZE]
    published = [h for e in plain for h in e.block_hashes]
    assert published[:3] == [external(d) for d in hasher.chain(None, prompt, BLOCK_SIZE)]

    salted = stored_events(engine, {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                    "cache_salt": "tenant-a"})
    published = [h for e in salted for h in e.block_hashes]
    mine = [external(d) for d in hasher.chain(None, prompt, BLOCK_SIZE, first_keys=(("cache_salt", "tenant-a"),))]
    assert published[:3] == mine
    assert set(mine).isdisjoint(external(d) for d in hasher.chain(None, prompt, BLOCK_SIZE))
    # and published untagged, as the simulator publishes them: the salt on the first block only
    assert [list(k) if k else None for k in salted[0].extra_keys or []][:2] == [["tenant-a"], None]


VLLM_HASHES = r"""
import json, os, sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kv
answers = []
for case in json.loads(sys.stdin.read()):
    os.environ.pop("PYTHONHASHSEED", None)
    if case["seed"] is not None:
        os.environ["PYTHONHASHSEED"] = case["seed"]
    fn = get_hash_fn_by_name(case["algo"])
    kv.init_none_hash(fn)
    parent, out = None, []
    for i, block in enumerate(case["blocks"]):
        keys = case["every"] + (case["first"] if i == 0 else [])
        keys = tuple(tuple(k) for k in keys) or None
        parent = kv.hash_block_tokens(fn, parent, block, keys)
        out.append(parent.hex())
    answers.append({"seed": kv.get_none_hash_seed(), "none": kv.NONE_HASH.hex(), "hashes": out})
print(json.dumps(answers))
"""


def test_vllms_hash_functions_agree_with_the_simulators(real_env, monkeypatch):
    """vLLM's own functions (one process of the real-vLLM venv) against ``simulator.hashing``: both
    SHA-256 algorithms, vLLM's default seed and a PYTHONHASHSEED, no extra keys, a salt (non-ASCII),
    a salt and an adapter. (The venv has no xxhash, so vLLM cannot compute the xxhash ones here.)"""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    rng = random.Random(7)
    tokens = [rng.randrange(0, 200_000) for _ in range(4 * 16)]
    blocks = [tokens[i:i + 16] for i in range(0, len(tokens), 16)]
    salt = [["cache_salt", "tenant-\u00e9"]]
    adapter = [["lora", "sql-adapter", "/adapters/sql"]]
    cases = [{"algo": algo, "seed": seed, "blocks": blocks, "first": first, "every": every}
             for algo in ("sha256", "sha256_cbor") for seed in (None, "1234")
             for first, every in (([], []), (salt, []), (salt, adapter))]
    out = subprocess.run([str(real_env.python), "-c", VLLM_HASHES], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"})
    assert out.returncode == 0, out.stderr[-3000:]
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(answers) == len(cases) == 12
    for case, theirs in zip(cases, answers):
        hasher = BlockHasher(case["algo"], case["seed"])
        assert hasher.seed == theirs["seed"]
        assert hasher.root.hex() == theirs["none"], case
        mine = hasher.chain(None, tokens, 16, first_keys=tuple(tuple(k) for k in case["first"]) or None,
                            every_keys=tuple(tuple(k) for k in case["every"]) or None)
        assert [d.hex() for d in mine] == theirs["hashes"], case
    # the cases differ from one another (a hasher that ignored a key or the seed would fail above)
    assert len({tuple(a["hashes"]) for a in answers}) == 12
