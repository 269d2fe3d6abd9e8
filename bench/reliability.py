"""Reliability report: every fault scenario of tests/faults, in its longer version, as one table.

    python bench/reliability.py            # about 3 minutes
    python bench/reliability.py --quick    # the CI lengths
    python bench/reliability.py --json results/reliability.json
    python bench/reliability.py --attacks-only   # only the attack table (issue 13), about 1.5 minutes

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

from bench.provenance import stamp  # noqa: E402
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


# The attack table: each attack is a regression test of tests/test_abuse_*.py that sends what an
# attacker would (raw bytes where they matter) and asserts the answer; "observed" is its outcome.
ATTACKS = [
    ("test_client_kv_transfer_params_never_reach_the_engine", "sidecar: kv_transfer_params with an escaped key, NaN, "
     "lone surrogate, big int, duplicate key", "stripped before the engine; other values exact"),
    ("test_utf16_body_and_bom", "sidecar: the same in UTF-16 or after a BOM", "stripped"),
    ("test_every_path_that_reaches_the_engine", "sidecar: /v1/completions/, //v1/..., /v1/%63ompletions, /tokenize",
     "stripped on every path"),
    ("test_a_body_that_cannot_be_parsed", "sidecar: unparsable JSON to generation paths", "400, nothing forwarded"),
    ("test_websocket_upgrade_is_a_clean_answer", "sidecar: WebSocket upgrade with Authorization, log at debug",
     "no 500/101; key not logged"),
    ("test_asterisk_target", "sidecar: GET * / OPTIONS *", "400 without the decoder URL"),
    ("test_a_60_kb_request_id", "sidecar: 60 KB x-request-id", "200, id replaced (was 502)"),
    ("test_idle_slow_and_http10_chunked_clients_are_bounded", "sidecar: idle, endless headers, 1-byte body "
     "trickle, HTTP/1.0 chunked, 100 KB header", "closed; closed; 408; 400; 431"),
    ("test_debug_route_and_metrics_need_an_admin_key", "router: /debug/route cache oracle, /metrics, /ready with an "
     "ordinary key", "403 / 403 / no pod count; admin 200"),
    ("test_priority_and_objective_headers_count_only", "router: x-priority critical/HIGH, x-slo-ttft-ms 1e5 and "
     "1e300 from an ordinary key", "429 (ignored), 429 (cannot loosen), 400 (bounded)"),
    ("test_a_batch_counts_every_prompt", "router: prompt [\"a\", 300k chars] and token-id batches",
     "counted as all prompts; next request 429"),
    ("test_prompt_tokens_are_charged_before_the_tokenizer_runs", "router: 2 MB prompt with 4k tokens left; "
     "a key in debt sends headers of a 5 MB body", "429 with no routing; 429 before the body"),
    ("test_idle_slow_header_and_slow_body_connections_are_closed", "router: 30 idle connections, trickled headers, "
     "trickled body on /debug/route and /health, idle keep-alive", "all closed within the timeouts; 408"),
    ("test_oversized_headers_and_http10_chunked", "router: 100 KB header, HTTP/1.0 chunked, 60 KB x-request-id",
     "431, 400, 200 with a fresh id"),
    ("test_no_secret_and_no_traceback_in_the_log", "router: ?api_key=, WebSocket Authorization, disconnect "
     "mid-body, log at debug with access log", "no key, no traceback, no ERROR in the log"),
    ("test_an_oversized_frame_is_refused", "KV events: 20 MB frame", "dropped (MAXMSGSIZE), stream resumes"),
    ("test_a_replay_answer_without_an_end_marker", "KV events: endless replay answer", "given up after the bound"),
    ("test_curve_lets_only_the_key_holder_publish", "KV events: a rogue publisher without the CURVE key",
     "nothing applied; the keyed one is"),
]


def attack_rows() -> list[tuple[str, str, str]]:
    """Run the attack tests (pytest, junit XML) and return (attack, expected, observed) rows."""
    import subprocess
    import xml.etree.ElementTree as ET

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "attacks.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                        "tests/test_abuse_sidecar.py", "tests/test_abuse_router.py", "tests/test_abuse_events.py"],
                       cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        cases = list(ET.parse(report).getroot().iter("testcase"))
    rows = []
    for prefix, attack, expected in ATTACKS:
        mine = [c for c in cases if c.get("name", "").startswith(prefix)]
        failed = [c for c in mine if c.find("failure") is not None or c.find("error") is not None]
        if not mine:
            observed = "not run"
        elif failed:
            observed = f"FAILED {len(failed)} of {len(mine)}"
        else:
            seconds = sum(float(c.get("time", 0)) for c in mine)
            observed = f"as expected ({len(mine)} case{'s' if len(mine) > 1 else ''}, {seconds:.1f} s)"
        rows.append((attack, expected, observed))
    return rows


def attack_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| attack | expected | observed |", "|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


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
    ap.add_argument("--attacks-only", action="store_true", help="only the attack table (issue 13)")
    args = ap.parse_args(argv)
    attacks = attack_rows()
    print(attack_table(attacks))
    met = sum(1 for _, _, o in attacks if o.startswith("as expected"))
    if args.attacks_only:
        print(f"\n{met} of {len(attacks)} attacks refused or bounded as expected")
        return 0 if met == len(attacks) else 1
    print()
    rows = asyncio.run(run_all(args.quick))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({**stamp("reliability.py", argv), "rows": [r.__dict__ for r in rows]},
                                              indent=1, default=str))
    overload = next(r for r in rows if r.fault == "overload").figures
    lost = sum(r.sent - r.answered for r in rows) - sum(r.figures.get("kinds", {}).get("refused", 0) for r in rows)
    print(f"\n{met} of {len(attacks)} attacks refused or bounded; {len(rows)} faults survived; "
          f"requests sent {sum(r.sent for r in rows)}, answered {sum(r.answered for r in rows)}, "
          f"lost without an answer {lost} (refused connections while no router "
          f"listened excluded); under 5x overload /health p99 {overload['health_p99_ms']:.1f} ms, "
          f"RSS {overload['rss_before_mib']:.0f} -> {overload['rss_peak_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
