"""``kvroute events`` against a real PUB/ROUTER pair publishing vLLM's frames."""

from __future__ import annotations

import io
import json
import threading

import zmq

from indexer import wire
from indexer.cli import main
from indexer.events import encode_seq
from tests.helpers import free_ports, kvroute_process


def _serve(stop, pub_port, rep_port, batches):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{rep_port}")
    seq = len(batches)
    try:
        while not stop.is_set():
            if router.poll(20):
                ident, _, start = router.recv_multipart()
                for s, payload in enumerate(batches):
                    if s >= int.from_bytes(start, "big"):
                        router.send_multipart([ident, b"", b"kv@p@m", encode_seq(s), payload])
                router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
            pub.send_multipart(wire.frames("kv@p@m", seq, wire.encode_batch([wire.removed([seq])], ts=2.0)))
            seq += 1
    finally:
        pub.close(0)
        router.close(0)
        ctx.term()


def test_replay_then_live_json_lines():
    pub_port, rep_port = free_ports(2)
    batches = [wire.encode_batch([wire.stored([2**64 - 1, 5], None, list(range(32)), 16, lora_name="ad")],
                                 ts=1.0, dp_rank=3),
               wire.encode_batch([wire.cleared()], ts=1.5)]
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(stop, pub_port, rep_port, batches), daemon=True)
    t.start()
    out, err = io.StringIO(), io.StringIO()
    try:
        rc = main([f"tcp://127.0.0.1:{pub_port}", "--replay", f"tcp://127.0.0.1:{rep_port}", "--from-seq", "0",
                   "--count", "4", "--timeout", "5"], out=out, err=err)
    finally:
        stop.set()
        t.join(5)
    assert rc == 0, err.getvalue()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert len(lines) == 4
    first = lines[0]
    assert first["seq"] == 0 and first["source"] == "replay" and first["dp_rank"] == 3 and first["topic"] == "kv@p@m"
    ev = first["events"][0]
    assert ev["type"] == "BlockStored" and ev["block_hashes"] == [2**64 - 1, 5] and ev["lora_name"] == "ad"
    assert ev["block_size"] == 16 and ev["medium"] == "GPU" and len(ev["token_ids"]) == 32
    assert lines[1]["events"] == [{"type": "AllBlocksCleared"}]
    assert all(x["source"] == "live" and x["events"][0]["type"] == "BlockRemoved" for x in lines[2:])


def test_timeout_with_nothing_is_exit_1_and_bad_args_exit_2():
    (port,) = free_ports(1)
    err = io.StringIO()
    assert main([f"tcp://127.0.0.1:{port}", "--timeout", "0.2"], out=io.StringIO(), err=err) == 1
    assert main([f"tcp://127.0.0.1:{port}", "--from-seq", "3"], out=io.StringIO(), err=err) == 2
    assert "--from-seq needs --replay" in err.getvalue()
    assert main(["not-an-endpoint", "--timeout", "0.1"], out=io.StringIO(), err=err) == 2


def test_kvroute_events_subcommand_runs():
    (port,) = free_ports(1)
    with kvroute_process(["events", f"tcp://127.0.0.1:{port}", "--timeout", "0.3"]) as proc:
        assert proc.wait(timeout=20) == 1
