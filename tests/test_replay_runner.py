"""The runner's measurements against a real streaming backend on loopback with known timing."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web

from replay import arrivals, fake_backend, runner, workloads
from replay.fake_backend import Behaviour
from replay.metrics import RequestRecord, peak_concurrency, summarize
from replay.report import format_compare, format_table
from tests.helpers import free_port, serve_routes


@pytest.fixture
async def backend():
    started = []

    async def start(**kw):
        port = free_port()
        app_runner = await fake_backend.start(port, Behaviour(**kw))
        state = app_runner.app[fake_backend.STATE_KEY]
        started.append(app_runner)
        return f"http://127.0.0.1:{port}", state

    yield start
    for r in started:
        await r.cleanup()


def _specs(n=6, output_len=5, sys_len=64, q_len=16, groups=2):
    return workloads.shared_prefix(num_groups=groups, prompts_per_group=n // groups, system_prompt_len=sys_len,
                                   question_len=q_len, output_len=output_len)


async def test_metrics_match_known_timing(backend):
    url, state = await backend(ttft=0.1, itl=0.02, pods=("pod-a", "pod-b"))
    specs = _specs()
    res = await runner.run(url, specs, arrivals.constant(len(specs), 50.0), model="fake-model", slo_ttft=1.0)
    s = res.summary
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (6, 6, 0, 0)
    for r in res.records:
        assert r.ok and r.output_tokens == 5 and len(r.itls) == 4
        assert 0.1 <= r.ttft < 1.0
        # a gap is measured where the client reads a chunk: a busy client may read two chunks
        # together (one long gap, one near zero), so check the gaps' structure, not each length
        assert all(0 <= g < 0.5 for g in r.itls)
        assert sum(r.itls) <= r.e2e - r.ttft + 1e-6
        assert 0.18 <= r.e2e < 1.5
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 4)
    assert 100 <= s["median_ttft_ms"] < 1000 and 10 <= s["median_itl_ms"] < 200
    assert s["ttft_p50"] == pytest.approx(s["median_ttft_ms"] / 1000)
    assert s["per_pod"] == {"pod-a": 3, "pod-b": 3}
    assert s["slo_attainment"] == 1.0 and s["request_goodput"] > 0
    assert s["total_input_tokens"] == 6 * 80 and s["total_output_tokens"] == 30
    assert s["lateness_p99_ms"] >= 0 and s["lateness_max_ms"] >= s["lateness_p99_ms"]
    # the bodies the backend received are the workload's prompts, streamed with usage
    assert len(state.headers) == 6


async def test_rejections_count_as_slo_misses(backend):
    url, _ = await backend(reject_every=2)
    specs = _specs()
    res = await runner.run(url, specs, arrivals.constant(len(specs), 100.0), model="fake-model", slo_ttft=5.0)
    s = res.summary
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (6, 3, 3, 0)
    assert s["errors_by_status"] == {"429": 3}
    assert s["slo_attainment"] == pytest.approx(0.5)  # the 3 rejected requests are misses
    assert s["slo_met"] == 3


async def test_slow_ttft_misses_slo_and_slo_header_sent(backend):
    url, state = await backend(ttft=0.06)
    specs = _specs(n=2, groups=1)
    res = await runner.run(url, specs, [0.0, 0.01], model="fake-model", slo_ttft=0.05, send_slo_header=True)
    assert res.summary["slo_attainment"] == 0.0 and res.summary["completed"] == 2
    assert [h.get("x-slo-ttft-ms") for h in state.headers] == ["50", "50"]
    res2 = await runner.run(url, specs, [0.0, 0.01], model="fake-model")
    assert res2.summary["slo_attainment"] is None  # no objective given
    assert all("x-slo-ttft-ms" not in h for h in state.headers[2:])


async def test_hit_rate_from_pod_metrics(backend):
    url, _ = await backend()
    specs = _specs(n=6, groups=2, sys_len=64, q_len=16)
    res = await runner.run(url, specs, arrivals.constant(6, 20.0), model="fake-model", pod_metrics=[url])
    # 16-token blocks: each group's first request misses its 64-token system prompt, the other
    # two hit it; questions always miss.
    assert res.summary["hit_rate"] == pytest.approx(4 * 64 / (6 * 80))
    assert res.summary["usage_hit_rate"] == pytest.approx(4 * 64 / (6 * 80))
    assert res.summary["hit_rate_per_pod"] == {url: pytest.approx(4 * 64 / (6 * 80))}
    # a second run measures only its own traffic (counters read before and after)
    res2 = await runner.run(url, specs[:2], [0.0, 0.05], model="fake-model", pod_metrics=[url, "http://127.0.0.1:1"])
    assert res2.summary["hit_rate"] == pytest.approx(1.0)
    assert res2.summary["pod_metrics_unreachable"] == ["http://127.0.0.1:1"]


async def test_max_concurrency_queues_without_counting_as_lateness(backend):
    url, _ = await backend(ttft=0.1)
    specs = _specs(n=4, groups=1)
    res = await runner.run(url, specs, [0.0] * 4, model="fake-model", max_concurrency=1)
    s = res.summary
    assert s["completed"] == 4 and s["max_concurrent_requests"] == 1
    assert s["queue_time_p99_ms"] >= 200
    assert s["lateness_max_ms"] < 100
    assert sorted(round(r.queue_time, 1) for r in res.records)[-1] >= 0.3


async def test_duration_and_max_requests_limit_what_is_sent(backend):
    url, state = await backend()
    specs = _specs(n=20, groups=2)
    res = await runner.run(url, specs, arrivals.constant(20, 10.0), model="fake-model", duration=0.45)
    assert res.summary["requests"] == 5 and state.requests == 5
    res = await runner.run(url, specs, arrivals.constant(20, 100.0), model="fake-model", max_requests=3)
    assert res.summary["requests"] == 3


async def test_several_targets_take_the_requests_in_turn(backend):
    """Router replicas without a load balancer: request i goes to target i % n, every one answered."""
    url_a, state_a = await backend()
    url_b, state_b = await backend()
    specs = _specs(n=7, groups=1)
    res = await runner.run([url_a, url_b + "/v1"], specs, arrivals.constant(7, 100.0), model="fake-model")
    assert res.summary["completed"] == 7
    assert (state_a.requests, state_b.requests) == (4, 3)
    assert res.config["target"] == [url_a, url_b]
    with pytest.raises(runner.RunError):
        await runner.run([], specs, arrivals.constant(7, 100.0), model="fake-model")


async def test_dropped_stream_and_unreachable_target_are_errors(backend):
    url, _ = await backend(itl=0.01)
    specs = _specs(n=2, groups=1)
    res = await runner.run(url, specs, [0.0, 0.0], model="fake-model", headers={"x-fake-drop": "2"}, slo_ttft=10)
    s = res.summary
    assert s["completed"] == 0 and s["errors"] == 2 and s["slo_attainment"] == 0.0
    assert s["errors_by_status"] == {"incomplete": 2}
    dead = f"http://127.0.0.1:{free_port()}"
    res = await runner.run(dead, specs, [0.0, 0.0], model="m", slo_ttft=10)
    assert res.summary["errors_by_status"] == {"connection": 2} and res.summary["slo_attainment"] == 0.0
    with pytest.raises(runner.RunError, match="cannot list models"):
        await runner.run(dead, specs, [0.0], model=None)


async def test_other_status_and_chat_endpoint_and_model_discovery(backend):
    url, state = await backend(ttft=0.02, itl=0.01)
    specs = _specs(n=2, groups=1)
    res = await runner.run(url + "/v1", specs, [0.0, 0.0], endpoint="chat", headers={"x-fake-status": "503"})
    assert res.summary["errors_by_status"] == {"503": 2} and res.config["model"] == "fake-model"
    res = await runner.run(url, specs, [0.0, 0.0], endpoint="chat")
    assert res.summary["completed"] == 2
    assert all(r.ttft >= 0.02 and r.output_tokens == 5 for r in res.records)


def test_summarize_and_peak_concurrency_pure():
    recs = [
        RequestRecord(0, 0.0, 10, sent=0.0, lateness=0.001, status=200, ttft=0.1, e2e=0.5, itls=[0.1] * 4,
                      output_tokens=5),
        RequestRecord(1, 0.1, 10, sent=0.1, lateness=0.003, status=200, ttft=0.3, e2e=0.7, itls=[0.1] * 4,
                      output_tokens=5),
        RequestRecord(2, 0.2, 10, sent=0.2, lateness=0.002, status=429, error="busy"),
        RequestRecord(3, 0.3, 10, sent=0.3, lateness=0.0, status=500, error="boom"),
    ]
    s = summarize(recs, duration=1.0, slo_ttft=0.2, slo_tpot=0.2)
    assert s["requests"] == 4 and s["completed"] == 2 and s["rejected"] == 1 and s["errors"] == 1
    assert s["slo_attainment"] == 0.25 and s["request_goodput"] == 1.0
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["mean_tpot_ms"] == pytest.approx(100)
    assert s["mean_e2el_ms"] == pytest.approx(600) and s["lateness_max_ms"] == pytest.approx(3)
    assert s["max_concurrent_requests"] == 2
    # over all 4 sent: 0.1, 0.3, then two that never had a first token
    assert (s["ttft_p50_all"], s["ttft_p99_all"]) == (0.3, float("inf")) and s["ttft_p99"] == pytest.approx(0.298)
    assert s["admitted_late"] == 0.25  # the 0.3 s one was let through and missed the 0.2 s objective
    assert summarize(recs[:2], duration=1.0)["admitted_late"] is None  # no objective, no lateness
    assert summarize(recs, duration=1.0, slo_ttft=0.2, slo_tpot=0.05)["slo_attainment"] == 0.0
    assert peak_concurrency([(0, 1), (1, 2), (0.5, 1.5)]) == 2


async def test_drain_timeout_cancels_and_counts_unfinished_requests(backend):
    url, _ = await backend(ttft=2.0)
    specs = _specs(n=3, groups=1)
    res = await runner.run(url, specs, [0.0, 0.0, 0.0], model="fake-model", max_concurrency=1, drain_timeout=0.2,
                           slo_ttft=5.0)
    s = res.summary
    assert s["requests"] == 3 and s["completed"] == 0
    assert s["errors_by_status"] == {"cancelled": 3} and s["slo_attainment"] == 0.0


@pytest.mark.e2e
async def test_an_answer_the_client_cannot_read_is_a_failure_not_a_success():
    """A stream whose usage is garbage raised inside the request's task: the record stayed status 200 with no
    error, so it counted as completed and met the objective (and 'Task exception was never retrieved')."""
    async def answer(request: web.Request) -> web.StreamResponse:
        usage = {"completion_tokens": "n/a"} if request.headers.get("x-mode") == "str" else [1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                         + b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with serve_routes(web.post("/v1/completions", answer)) as port:
        specs = _specs(n=2, groups=1)
        for mode in ("str", "list"):
            res = await runner.run(f"http://127.0.0.1:{port}", specs, [0.0, 0.0], model="m", slo_ttft=5.0,
                                   headers={"x-mode": mode})
            s = res.summary
            assert (s["requests"], s["completed"], s["errors"], s["slo_attainment"]) == (2, 0, 2, 0.0)
            assert all(r.error and r.error.startswith("bad_response:") for r in res.records)


@pytest.mark.e2e
async def test_unsorted_arrivals_are_cut_by_time_not_by_list_order(backend):
    url, state = await backend()
    specs = _specs(n=3, groups=1)
    res = await runner.run(url, specs, [0.5, 0.0, 0.1], model="fake-model", duration=0.3)
    assert res.summary["requests"] == 2 and state.requests == 2  # before: all 3, the one at 0.5 s included
    assert sorted(r.scheduled for r in res.records) == [0.0, 0.1]


@pytest.mark.e2e
async def test_the_fake_backend_keeps_a_bounded_header_log(backend, monkeypatch):
    monkeypatch.setattr(fake_backend, "MAX_HEADERS", 3)
    url, state = await backend()
    specs = _specs(n=6, groups=1)
    res = await runner.run(url, specs, arrivals.constant(6, 200.0), model="fake-model")
    assert res.summary["completed"] == 6 and state.requests == 6 and len(state.headers) == 3


def test_table_and_compare_show_ttft_over_all_requests_sent():
    """The plain TTFT rows cover successful requests only: with rejections the table also gives the
    percentiles over ALL requests sent ('miss' where the rank falls on a rejection), saved files too."""
    recs = [RequestRecord(i, 0.0, 10, sent=0.0, status=200, ttft=0.2 + i / 100, e2e=1.0, output_tokens=2)
            for i in range(21)]
    recs += [RequestRecord(21 + i, 0.0, 10, sent=0.0, status=429, error="busy") for i in range(39)]
    s = summarize(recs, duration=1.0, slo_ttft=0.5)
    assert s["p99_ttft_ms"] == pytest.approx(398.0) and s["ttft_p90_all"] == float("inf")
    table = format_table(s, definitions=False)
    assert "P99 TTFT, all sent (ms):                miss" in table
    saved = orjson.loads(orjson.dumps({"summary": s}))  # JSON has no infinity: null once saved
    row = next(line for line in format_compare([saved], ["rr"]).splitlines() if line.startswith("P99 TTFT all"))
    assert row.split()[-1] == "miss"
    ok = summarize(recs[:21], duration=1.0)
    assert "all sent" not in format_table(ok, definitions=False)  # nothing left out: no extra rows
    assert ok["ttft_p50_all"] == pytest.approx(0.3) and ok["ttft_p99_all"] == pytest.approx(0.4)
    lines = format_compare([{"summary": ok}], ["a"]).splitlines()
    row = next(line for line in lines if line.startswith("P99 TTFT all"))
    assert row.split()[-1] == "400.00"
    assert format_compare([{"summary": {"requests": 3}}], ["old"]).count("miss") == 0  # older files: no key, "-"
