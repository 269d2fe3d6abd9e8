"""Booking-bus propagation latency on loopback: from one process's ``Ledger.book`` to the booking
standing in another process's ledger.

Processes as in production: a sender (books at ``--rate`` per second, each booking's token count
carrying its send time on the shared CLOCK_MONOTONIC) and a receiver (this process: a
``BookingBus`` on an asyncio loop, noting when each booking is applied). ``workers``: the sender
binds an IPC socket in a private directory and the receiver connects to it, as the workers of
``kvroute serve --workers N`` do; ``forwarder``: through the forwarder ``kvroute serve --workers N``
runs in its parent process beside replicas (a third process); ``replicas``: the receiver connects
straight to the sender's TCP bind on 127.0.0.1, as router replicas do. Each row
also has the receiver's CPU per message received (``recv_cpu_us_per_message``: the whole
process's CPU time, its ZeroMQ I/O thread included, from the go to the sender's end, over the
books and releases it applied; each book and release goes as its own message here). The latency
percentiles are over every booking sent: one that never arrived counts at infinity (``missing``).
The last line is the headline; ``--out`` writes the rows with the command and the commit.

    python bench/bookbus_latency.py [--topology workers,forwarder,replicas] [--messages 3000] [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import stamp  # noqa: E402
from router.bookbus import BookingBus  # noqa: E402
from router.booking import Ledger  # noqa: E402

SENDER = textwrap.dedent("""
    import asyncio, sys, time
    from router.bookbus import BookingBus
    from router.booking import Ledger

    async def main(topology, endpoint, n, rate):
        kw = {"pub_connect": [endpoint]} if topology == "forwarder" else {"pub_bind": [endpoint]}
        bus = BookingBus(Ledger(), snapshot_s=0.5, **kw)
        await bus.start()
        print("up", flush=True)
        sys.stdin.readline()  # the receiver hears our snapshots: go
        for i in range(n):
            t = bus.ledger.book(f"p{i % 8}", time.monotonic())
            await asyncio.sleep(0)
            bus.ledger.release(f"p{i % 8}", t)
            await asyncio.sleep(1.0 / rate)
        await asyncio.sleep(1.0)
        await bus.stop()

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
""")
FORWARDER = textwrap.dedent("""
    import sys, time
    from router.bookbus import Forwarder
    f = Forwarder().start()
    print(f.pub_endpoint, f.sub_endpoint, flush=True)
    sys.stdin.readline()
    f.stop()
""")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("inf")


async def run(topology: str, messages: int, rate: float) -> dict:
    procs = []
    siblings = None
    if topology == "workers":
        from router.bookbus import sibling_endpoint, siblings_directory

        siblings = siblings_directory()
        send_ep = sibling_endpoint(siblings, 1)  # the sender's socket, named as a worker's would be
        recv = BookingBus(Ledger(), sub_connect=[send_ep])
    elif topology == "forwarder":
        fwd = subprocess.Popen([sys.executable, "-c", FORWARDER], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        procs.append(fwd)
        assert fwd.stdout is not None
        pub_ep, sub_ep = fwd.stdout.readline().split()
        recv = BookingBus(Ledger(), sub_connect=[sub_ep])
        send_ep = pub_ep
    else:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        send_ep = f"tcp://127.0.0.1:{port}"
        recv = BookingBus(Ledger(), sub_connect=[send_ep])
    latencies: list[float] = []
    apply = recv.ledger.apply_foreign

    def timed(origin, event, pod, ticket, tokens=0.0, resource="prefill", max_per_origin=None):
        now = time.monotonic()
        done = apply(origin, event, pod, ticket, tokens, resource, max_per_origin)
        if done and event == "book":
            latencies.append(now - tokens)
        return done

    recv.ledger.apply_foreign = timed  # type: ignore[method-assign]
    await recv.start()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, topology, send_ep, str(messages), str(rate)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(sender)
    try:
        assert sender.stdout is not None and sender.stdin is not None
        sender.stdout.readline()
        deadline = time.monotonic() + 30
        while not recv.peers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        latencies.clear()  # snapshots before the go
        cpu0, got0 = time.process_time(), received(recv)
        sender.stdin.write("go\n")
        sender.stdin.flush()
        while sender.poll() is None:
            await asyncio.sleep(0.1)
        cpu_us = (time.process_time() - cpu0) / max(received(recv) - got0, 1) * 1e6
    finally:
        await recv.stop()
        for p in procs:
            if p.poll() is None:
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait(10)
        if siblings is not None:
            shutil.rmtree(siblings, ignore_errors=True)
    ms = [x * 1000 for x in latencies]
    missing = max(messages - len(ms), 0)
    sent = ms + [float("inf")] * missing  # a booking that never stood in the receiver's ledger: a miss
    return {"topology": topology, "messages": messages, "received": len(ms), "missing": missing, "rate_per_s": rate,
            "lost": recv.stats.get("lost", "dropped"),
            "p50_ms": round(pct(sent, 0.5), 3), "p99_ms": round(pct(sent, 0.99), 3),
            "max_ms": round(max(sent, default=float("inf")), 3),
            "mean_received_ms": round(statistics.fmean(ms), 3) if ms else None,
            "recv_cpu_us_per_message": round(cpu_us, 2)}


def received(bus: BookingBus) -> int:
    return bus.stats.get("book", "received") + bus.stats.get("release", "received")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="workers,forwarder,replicas")
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=500.0, help="bookings per second (each also released)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows = [asyncio.run(run(t.strip(), args.messages, args.rate)) for t in args.topology.split(",") if t.strip()]
    for r in rows:
        print(f"{r['topology']:<9} {r['received']}/{r['messages']} bookings  p50 {r['p50_ms']:.3f} ms  "
              f"p99 {r['p99_ms']:.3f} ms  max {r['max_ms']:.3f} ms  lost {r['lost']}  "
              f"receiver CPU {r['recv_cpu_us_per_message']:.1f} us per message")
    if args.out:  # until 2026-12-06 a bare list of the rows, with ``mean_ms`` over the received ones
        Path(args.out).write_text(json.dumps({**stamp("bookbus_latency.py", argv), "rows": rows}, indent=2) + "\n")
    print("booking-bus propagation over every booking sent: " + "; ".join(
        f"{r['topology']} p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms ({r['missing']} missing)" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
