"""Reliability report: every fault scenario of tests/faults, in its longer version, as one table.

    python bench/reliability.py            # about 3 minutes
    python bench/reliability.py --quick    # the CI lengths
    python bench/reliability.py --json results/reliability.json

Each row: the fault, what was injected, what the clients saw (answers by kind), requests sent /
answered (an answer is a success, an OpenAI-style error, or a stream ending in an error event and
[DONE]; a refused connection while no router listens is counted as sent, not answered), and the
recovery time. The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faults import scenarios  # noqa: E402

RECOVERY = {
    "pod killed mid-stream": "dead pod out of the candidate set",
    "pod fails before first byte": "none needed (retried at once)",
    "slow pod": "last request sent to the slow pod",
    "KV events: gap, restart, silence": "gap repaired from replay",
    "router restart (SIGTERM)": "signal to new process ready",
    "router restart (SIGKILL)": "signal to new process ready",
    "prefill pod dies between legs": "fallback answer time",
    "overload": "load stopped to first request served",
}


async def run_all(quick: bool) -> list[scenarios.Row]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        plan = [
            ("pod_killed", lambda: scenarios.pod_killed(d, streams=6 if quick else 12)),
            ("fails_before_first_byte", lambda: scenarios.fails_before_first_byte(d, 12 if quick else 40)),
            ("slow_pod", lambda: scenarios.slow_pod(d, requests=30 if quick else 60)),
            ("event_faults", lambda: scenarios.event_faults(d, silence_s=1.5 if quick else 3.0)),
            ("router_restart", lambda: scenarios.router_restart(d, 6.0 if quick else 15.0, 15.0 if quick else 20.0)),
            ("router_crash", lambda: scenarios.router_restart(d, 6.0 if quick else 15.0, 15.0 if quick else 20.0,
                                                              hard=True)),
            ("sidecar", lambda: scenarios.sidecar_prefill_dies(d)),
            ("overload", lambda: scenarios.overload(d, duration_s=12.0 if quick else 60.0)),
        ]
        for name, make in plan:
            t0 = time.monotonic()
            row = await make()
            print(f"# {name}: {time.monotonic() - t0:.1f} s; {json.dumps(row.figures, default=str)}",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def table(rows: list[scenarios.Row]) -> str:
    head = ["fault", "injected", "what the clients saw", "sent / answered", "recovery", "recovery measures"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = r.table_row() + [RECOVERY.get(r.fault, "")]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI lengths instead of the long ones")
    ap.add_argument("--json", help="also write every row's figures here")
    args = ap.parse_args(argv)
    rows = asyncio.run(run_all(args.quick))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    overload = next(r for r in rows if r.fault == "overload").figures
    lost = sum(r.sent - r.answered for r in rows) - sum(r.figures.get("kinds", {}).get("refused", 0) for r in rows)
    print(f"\n{len(rows)} faults survived; requests sent {sum(r.sent for r in rows)}, answered "
          f"{sum(r.answered for r in rows)}, lost without an answer {lost} (refused connections while no router "
          f"listened excluded); under 5x overload /health p99 {overload['health_p99_ms']:.1f} ms, "
          f"RSS {overload['rss_before_mib']:.0f} -> {overload['rss_peak_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
