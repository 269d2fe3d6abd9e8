"""``kvroute events``: print a pod's decoded KV-event stream, one JSON line per batch.

The tool to reach for when routing looks wrong: it shows exactly what a pod announces (sequence
numbers, timestamps, DP rank, every event field, hashes as uint64). With ``--replay`` and
``--from-seq`` it first prints the batches still in the pod's replay buffer from that sequence on,
then follows the live stream.

Exit status: 0 after ``--count`` batches or a quiet ``--timeout`` with at least one batch printed,
1 if the timeout passed with nothing received, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import orjson
import zmq

from indexer.events import (
    END_SEQ,
    DecodeError,
    EventBatch,
    decode_frame,
    decode_payload,
    decode_seq,
    encode_seq,
    event_to_dict,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute events",
                                description="Print a pod's decoded KV-cache event stream, one JSON line per batch.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("endpoint", help="the pod's KV event PUB endpoint, e.g. tcp://10.0.0.5:5557 "
                                    "(an endpoint with '*' binds, for a publisher that connects in)")
    p.add_argument("--replay", metavar="ENDPOINT", default=None,
                   help="the pod's replay ROUTER endpoint, e.g. tcp://10.0.0.5:5558")
    p.add_argument("--from-seq", type=int, default=None, metavar="N",
                   help="with --replay: first print the buffered batches from sequence N on")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to ('' = everything)")
    p.add_argument("--count", type=int, default=0, metavar="N", help="stop after N batches (0 = never)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S",
                   help="stop after S seconds without a batch (0 = wait forever)")
    return p


def batch_json(topic: str, seq: int, batch: EventBatch, source: str) -> bytes:
    """One output line: the batch with every event field."""
    doc: dict[str, Any] = {"seq": seq, "ts": batch.ts, "dp_rank": batch.dp_rank, "topic": topic, "source": source,
                           "events": [event_to_dict(e) for e in batch.events]}
    return orjson.dumps(doc, default=_default)


def _default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        return obj.hex()
    if isinstance(obj, int):  # beyond 64 bits
        return str(obj)
    raise TypeError


def replay(ctx: zmq.Context[Any], endpoint: str, start: int, timeout_s: float, out: TextIO, err: TextIO) -> int:
    """Print every buffered batch from ``start``; returns how many were printed."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    printed = 0
    try:
        sock.send_multipart([b"", encode_seq(start)])
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                print(f"replay from {endpoint}: no end marker within {timeout_s}s", file=err)
                return printed
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                topic_raw, seq_raw, payload = frames
            elif len(frames) == 2:
                topic_raw, (seq_raw, payload) = b"", frames
            else:
                print(f"replay: unexpected {len(frames)}-frame reply, skipped", file=err)
                continue
            try:
                seq = decode_seq(seq_raw)
                if seq == END_SEQ or not payload:
                    return printed
                batch = decode_payload(payload)
            except DecodeError as exc:
                print(f"replay: undecodable batch skipped: {exc}", file=err)
                continue
            out.write(batch_json(topic_raw.decode("utf-8", "replace"), seq, batch, "replay").decode() + "\n")
            out.flush()
            printed += 1
    finally:
        sock.close(linger=0)


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.from_seq is not None and not args.replay:
        print("kvroute events: --from-seq needs --replay ENDPOINT", file=err)
        return 2
    if args.count < 0 or args.timeout < 0 or (args.from_seq is not None and args.from_seq < 0):
        print("kvroute events: --count, --timeout and --from-seq must not be negative", file=err)
        return 2
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    printed = 0
    try:
        try:
            sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode("utf-8"))
            if "*" in args.endpoint or "::" in args.endpoint:
                sub.bind(args.endpoint)
            else:
                sub.connect(args.endpoint)
        except zmq.ZMQError as exc:
            print(f"kvroute events: cannot open {args.endpoint}: {exc}", file=err)
            return 2
        if args.from_seq is not None:
            printed += replay(ctx, args.replay, args.from_seq, args.timeout or 5.0, out, err)
        last = time.monotonic()
        while not args.count or printed < args.count:
            wait_ms = 200
            if args.timeout:
                left = args.timeout - (time.monotonic() - last)
                if left <= 0:
                    return 0 if printed else 1
                wait_ms = max(1, int(min(left, 0.2) * 1000))
            if not sub.poll(wait_ms):
                continue
            frames = sub.recv_multipart()
            last = time.monotonic()
            try:
                topic, seq, batch = decode_frame(frames)
            except DecodeError as exc:
                print(f"undecodable frame skipped: {exc}", file=err)
                continue
            out.write(batch_json(topic, seq, batch, "live").decode() + "\n")
            out.flush()
            printed += 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sub.close(linger=0)
        ctx.term()
