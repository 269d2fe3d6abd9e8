"""Open-loop load in its own process (so the process measuring the router is not the one loading it):
``python -m tests.faults.load BASE RATE DURATION PROMPT_TOKENS OUT.json``; writes counts by outcome."""

from __future__ import annotations

import asyncio
import sys

import orjson

from tests.faults.harness import Tally, completion_body, open_loop, percentile


def main(argv: list[str]) -> int:
    base, rate, duration, tokens, out = argv[0], float(argv[1]), float(argv[2]), int(argv[3]), argv[4]
    tally = Tally()

    def body(i: int) -> dict:
        text = (f"load {i} " + "the quick brown fox jumps over the lazy dog " * (tokens // 44 + 1))[:tokens]
        return completion_body(text, max_tokens=4)

    asyncio.run(open_loop(base, rate, duration, body, tally, timeout_s=30))
    ok = [o.took_s for o in tally.outcomes if o.kind == "ok"]
    shed = [o for o in tally.outcomes if o.kind == "http-429"]
    result = {"sent": tally.sent, "answered": tally.answered, "kinds": tally.kinds(),
              "ok_took_p99_s": percentile(ok, 99) if ok else None,
              "retry_after_present": all(o.retry_after for o in shed),
              "shed_took_p99_s": percentile([o.took_s for o in shed], 99) if shed else None}
    with open(out, "wb") as f:
        f.write(orjson.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
