"""vLLM's ``GET /kv_event_sources`` against the router's ``kv_events`` (router/event_sources.py): a
router configured as the engines publish says they agree; one subscribed to another topic says
which engine disagrees, and how."""

from __future__ import annotations

import re

from realvllm.engines import router_pod
from tests.helpers import http
from tests.real_vllm.conftest import running_router, wait_for


def test_the_router_checks_each_engines_kv_event_sources(agg_engines, real_env, tmp_path):
    right = [router_pod(e) for e in agg_engines]
    wrong = [right[0], {**right[1], "kv_events": [{**right[1]["kv_events"][0], "topic": "kv@elsewhere@"}]}]
    for pods, expected in ((right, (0.0, 0.0)), (wrong, (0.0, 1.0))):
        with running_router(tmp_path, pods, tokenizer=str(real_env.tokenizer), kv_events_check_interval_s=0.5) as base:
            def seen() -> tuple[float | None, ...]:   # None: not checked yet
                text = http().get(base + "/metrics").text
                found = dict(re.findall(r'^kvroute_pod_kv_events_mismatch\{pod="([^"]+)"\} (\S+)$', text, re.M))
                return tuple(float(found[e.name]) if e.name in found else None for e in agg_engines)
            wait_for(lambda want=expected: seen() == want, 30, f"the gauges {expected}")
    logged = "".join(p.read_text(errors="replace") for p in tmp_path.glob("router-*.log"))
    assert "topic 'kv@elsewhere@'" in logged and agg_engines[1].topic in logged
