"""P/D scheduling on hand-built fleets: decode choice, the four deciders, the prefill choice, admission."""

from __future__ import annotations

import pytest

from router.scheduling.pd import DecodeView, PDParams, decide_pd, predicted_tpot, transfer_seconds
from router.scheduling.snapshot import Candidate, RequestView


def dec(pid, cached=0.0, running=0, kv_usage=0.0, capacity=100_000, booked=0.0, queue=0.0, active=0):
    c = Candidate(pod_id=pid, role="decode", running=running, kv_usage=kv_usage, queue_tokens=queue,
                  effective_cached_tokens=cached, cached_tokens=int(cached), overhead_s=0.005)
    return DecodeView(candidate=c, kv_capacity_tokens=capacity, kv_booked_tokens=booked, active_requests=active)


def pre(pid, cached=0.0, queue=0.0):
    return Candidate(pod_id=pid, role="prefill", queue_tokens=queue, effective_cached_tokens=cached,
                     cached_tokens=int(cached), overhead_s=0.005)


def req(n, objective=None, exempt=False):
    return RequestView(prompt_tokens=n, objective_s=objective, exempt=exempt)


def test_transfer_time_is_bytes_over_bandwidth_plus_latency():
    p = PDParams(kv_bytes_per_token=1000, link_bandwidth_bytes_per_s=1e6, link_latency_s=0.002)
    assert transfer_seconds(500, p) == pytest.approx(0.502)
    assert transfer_seconds(0, p) == 0.0


def test_predicted_remote_when_the_decode_pod_is_busy_prefilling():
    # the decode pod has 40k tokens of local prefill queued (2 s); a prefill pod is idle
    d = decide_pd([dec("d0", queue=40_000)], [pre("p0")], req(4000), 100, PDParams(decider="predicted"))
    o = d.chosen
    assert o.mode == "remote" and o.prefill_pod == "p0"
    assert o.ttft_s < o.local.ttft_s
    assert "beats local" in o.reason


def test_predicted_local_when_the_decode_pod_holds_the_context():
    # the follow-up turn: 3,900 of 4,000 tokens cached on the decode pod, none on the prefill pod
    d = decide_pd([dec("d0", cached=3900)], [pre("p0")], req(4000), 100, PDParams(decider="predicted"))
    assert d.chosen.mode == "local" and d.chosen.prefill_pod is None
    assert "beats remote" in d.chosen.reason


def test_predicted_counts_the_transfer():
    # a slow link makes the remote path lose even though the decode pod is somewhat busy
    slow = PDParams(decider="predicted", link_bandwidth_bytes_per_s=1e8)  # 4000 x 128 KiB = 5.2 s
    d = decide_pd([dec("d0", queue=10_000)], [pre("p0")], req(4000), 100, slow)
    assert d.chosen.mode == "local"
    assert d.chosen.remote.transfer_s > 5


def test_always_never_and_prefix_deciders():
    decodes, prefills = [dec("d0", cached=3900)], [pre("p0")]
    assert decide_pd(decodes, prefills, req(4000), 10, PDParams(decider="always")).chosen.mode == "remote"
    assert decide_pd(decodes, prefills, req(4000), 10, PDParams(decider="never")).chosen.mode == "local"
    # prefix: 100 uncached < 256 -> local; a cold decode pod -> remote; a short prompt -> local
    p = PDParams(decider="prefix", non_cached_tokens=256, prompt_tokens=1000)
    assert decide_pd(decodes, prefills, req(4000), 10, p).chosen.mode == "local"
    assert decide_pd([dec("d0")], prefills, req(4000), 10, p).chosen.mode == "remote"
    assert decide_pd([dec("d0")], prefills, req(800), 10, p).chosen.mode == "local"


def test_no_prefill_pod_means_local_even_for_always():
    d = decide_pd([dec("d0")], [], req(4000), 10, PDParams(decider="always"))
    assert d.chosen.mode == "local" and "no prefill pod" in d.chosen.reason


def test_several_prompts_or_choices_are_planned_local_even_for_always():
    # vLLM answers a batch with one prompt's kv_transfer_params, so the sidecar prefills such a request
    # on the decode pod: the plan (and the booking) must say so, not a prefill pod that never sees it
    from kvcommon.transfer import one_prefill_cannot_serve
    batch = RequestView(prompt_tokens=4000, single_prefill=False)
    for decider in ("always", "predicted"):
        d = decide_pd([dec("d0", queue=40_000)], [pre("p0")], batch, 10, PDParams(decider=decider))
        assert d.chosen.mode == "local" and d.chosen.prefill_pod is None and "several" in d.chosen.reason
    assert one_prefill_cannot_serve({"prompt": ["a", "b"]}, "/v1/completions") == "several_prompts"
    assert one_prefill_cannot_serve({"prompt": [1, 2, 3]}, "/v1/completions") is None
    assert one_prefill_cannot_serve({"messages": [], "n": 2}, "/v1/chat/completions") == "several_choices"


def test_prefill_pod_by_predicted_ttft_including_its_cache_and_queue():
    prefills = [pre("p-busy", queue=20_000), pre("p-cold"), pre("p-warm", cached=3000)]
    d = decide_pd([dec("d0")], prefills, req(4000), 10, PDParams(decider="always"))
    ranking = [r.prefill_pod for r in d.chosen.remote_ranking]
    assert ranking == ["p-warm", "p-cold", "p-busy"]


def test_decode_pod_needs_kv_room_for_prompt_and_output():
    full = dec("d-full", kv_usage=0.95, capacity=100_000)         # 5,000 free
    booked = dec("d-booked", capacity=100_000, booked=97_000)     # 3,000 free after bookings
    ok = dec("d-ok", kv_usage=0.5, capacity=100_000, running=30)  # 50,000 free, but busier
    d = decide_pd([full, booked, ok], [pre("p0")], req(4000), 2000, PDParams())
    assert d.chosen.decode_pod == "d-ok"
    assert [o.has_room for o in d.ranked] == [True, False, False]


def test_no_room_anywhere_is_rejected_unless_exempt():
    decodes = [dec("d0", kv_usage=0.99), dec("d1", kv_usage=0.98)]
    d = decide_pd(decodes, [pre("p0")], req(4000), 100, PDParams())
    assert not d.verdict.admitted and d.verdict.reason == "kv" and d.chosen is None
    d = decide_pd(decodes, [pre("p0")], req(4000, exempt=True), 100, PDParams())
    assert d.verdict.admitted and d.chosen.decode_pod == "d1"  # the least short of room


def test_decode_pods_within_tpot_tolerance_are_ranked_by_ttft():
    # both lightly loaded (TPOTs within 10 %): the one holding the context wins on TTFT
    a, b = dec("d-a", running=2), dec("d-b", running=1, cached=3900)
    d = decide_pd([a, b], [pre("p0")], req(4000), 100, PDParams())
    assert d.chosen.decode_pod == "d-b" and d.chosen.mode == "local"
    # a pod far slower per output token loses even with the context
    slow = dec("d-b", running=1, cached=3900, kv_usage=0.9, capacity=1_000_000)
    d = decide_pd([a, slow], [pre("p0")], req(4000), 100, PDParams())
    assert d.chosen.decode_pod == "d-a"
    assert d.ranked[1].tpot_s > d.ranked[0].tpot_s * 1.1


def test_tpot_grows_with_batch_and_kv():
    p = PDParams()
    idle = predicted_tpot(dec("d"), 1000, p)
    assert predicted_tpot(dec("d", running=100), 1000, p) > idle
    assert predicted_tpot(dec("d", kv_usage=0.8), 1000, p) > idle


def test_admission_uses_the_best_ttft_over_both_paths():
    # 8,000 tokens behind 4,000 queued: local 0.6 s; remote 0.4 s prefill + 42 ms transfer, by which
    # time the decode pod's queue has drained: ~0.46 s. A 500 ms objective is met only remotely.
    decodes, prefills = [dec("d0", queue=4000)], [pre("p0")]
    d = decide_pd(decodes, prefills, req(8000, objective=0.5), 10, PDParams(decider="predicted"))
    assert d.verdict.admitted and d.chosen.mode == "remote" and d.chosen.ttft_s < 0.5 < d.chosen.local.ttft_s
    d = decide_pd(decodes, prefills, req(8000, objective=0.5), 10, PDParams(decider="never"))
    assert not d.verdict.admitted and d.verdict.reason == "slo"
    d = decide_pd(decodes, prefills, req(8000, objective=0.5, exempt=True), 10, PDParams(decider="never"))
    assert d.verdict.admitted and d.verdict.reason == "exempt"


def test_unknown_decider_is_an_error():
    with pytest.raises(ValueError):
        decide_pd([dec("d0")], [], req(10), 1, PDParams(decider="sometimes"))


def test_work_weight_counts_the_transfer_so_a_session_stays_where_its_context_is():
    # d-hold has the context but prefills slowly (4,000 tok/s); d-cold would need the whole context moved
    hold = DecodeView(candidate=Candidate(pod_id="d-hold", role="decode", effective_cached_tokens=1584,
                                          cached_tokens=1584, prefill_tokens_per_s=4000, overhead_s=0.005),
                      kv_capacity_tokens=65536)
    cold = DecodeView(candidate=Candidate(pod_id="d-cold", role="decode", prefill_tokens_per_s=4000, overhead_s=0.005),
                      kv_capacity_tokens=65536)
    d = decide_pd([cold, hold], [pre("p0", cached=1584)], req(1615), 4, PDParams(work_weight=3.0))
    assert d.chosen.decode_pod == "d-hold" and d.chosen.mode == "local"


def test_prefix_decider_with_zero_threshold_is_off_as_in_llm_d():
    p = PDParams(decider="prefix", non_cached_tokens=0, prompt_tokens=0)
    d = decide_pd([dec("d0")], [pre("p0")], req(4000), 10, p)
    assert d.chosen.mode == "local" and "disabled" in d.chosen.reason


def test_remote_path_waits_behind_the_decode_pods_own_prefill_queue():
    # the decode pod has 1 s of local prefill queued; the KV arrives after ~0.2 s and waits there
    busy = dec("d-busy", queue=20_000)
    d = decide_pd([busy], [pre("p0")], req(4000), 10, PDParams(decider="always"))
    remote = d.chosen.remote
    assert remote.ttft_s >= 1.0 > remote.prediction.ttft_s + remote.transfer_s
    # so with an idle second decode pod, the request goes there
    d = decide_pd([busy, dec("d-idle")], [pre("p0")], req(4000), 10, PDParams(decider="always"))
    assert d.chosen.decode_pod == "d-idle"


def test_a_new_decider_is_one_function_and_one_registration():
    from router.scheduling.pd import DECIDER_FUNCTIONS, decider

    @decider("test-remote-when-long")
    def long_prompts(local, remote, uncached, request, params):
        return ("remote", "long prompt") if request.prompt_tokens >= 3000 else ("local", "short prompt")

    try:
        params = PDParams(decider="test-remote-when-long")
        assert decide_pd([dec("d0")], [pre("p0")], req(4000), 10, params).chosen.mode == "remote"
        short = decide_pd([dec("d0")], [pre("p0")], req(100), 10, params).chosen
        assert (short.mode, short.reason) == ("local", "short prompt")
        assert decide_pd([dec("d0")], [], req(4000), 10, params).chosen.mode == "local"  # no prefill pod up
        with pytest.raises(ValueError, match="already registered"):
            decider("test-remote-when-long")(long_prompts)
    finally:
        DECIDER_FUNCTIONS.pop("test-remote-when-long")
    with pytest.raises(ValueError, match="unknown P/D decider 'test-remote-when-long'"):
        decide_pd([dec("d0")], [pre("p0")], req(4000), 10, PDParams(decider="test-remote-when-long"))


def test_the_headers_name_the_prefill_pod_and_the_decode_engine_of_a_data_parallel_pod():
    """A route's steering headers: the sidecar's prefill target on a remote route, and vLLM's
    X-data-parallel-rank whenever the pod the request is sent to is one engine of a data-parallel
    pod (aggregated, or the decode engine of a P/D route: the sidecar passes it to the decode leg)."""
    from router.config import PodConfig, data_parallel_ranks
    from router.disagg import prefill_header
    from router.scheduling.decide import Route
    from router.scheduling.snapshot import Prediction

    units = [*data_parallel_ranks(PodConfig(id="d", url="http://10.0.0.2:8000", model="m", role="decode",
                                            data_parallel_size=2)),
             PodConfig(id="p", url="http://10.0.0.1:8001", model="m", role="prefill"),
             PodConfig(id="a", url="http://10.0.0.3:8000", model="m")]
    pods = {u.id: u for u in units}
    pred = Prediction(queue_s=0, prefill_s=0, overhead_s=0, uncached_tokens=1)

    def route(pod: str, mode: str, prefill: str | None = None) -> Route:
        return Route(pod_id=pod, prefill_pod=prefill or pod, prediction=pred, ttft_s=0.1, cached_tokens=0, mode=mode)

    assert prefill_header(route("d#1", "remote", "p"), pods) == {"x-data-parallel-rank": "1",
                                                                 "x-prefiller-host-port": "10.0.0.1:8001"}
    assert prefill_header(route("d#0", "local"), pods) == {"x-data-parallel-rank": "0"}
    assert prefill_header(route("a", "aggregated"), pods) == {}
    assert prefill_header(route("a", "remote", "p"), pods) == {"x-prefiller-host-port": "10.0.0.1:8001"}


def test_decode_pods_are_ranked_by_admissions_own_test():
    """A decode pod whose median meets the objective but whose miss risk admission would refuse
    ranks after a safe one, whatever the work weight prefers (the aggregated ranking's rule)."""
    risky = DecodeView(candidate=Candidate(pod_id="d-risky", role="decode", cached_tokens=7000,
                                           effective_cached_tokens=7000.0, queue_tokens=16000, log_error_sd=0.4,
                                           overhead_s=0.01), kv_capacity_tokens=100_000)
    safe = DecodeView(candidate=Candidate(pod_id="d-safe", role="decode", log_error_sd=0.05, overhead_s=0.01),
                      kv_capacity_tokens=100_000)
    params = PDParams(decider="never", work_weight=3.0)
    d = decide_pd([risky, safe], [], req(8000, objective=1.0), 10, params, miss_tolerance=0.25)
    by_id = {o.decode_pod: o.local for o in d.ranked}  # risky 0.86 s (a 35 % risk), safe 0.41 s (none)
    assert by_id["d-risky"].ttft_s < 1.0 and by_id["d-risky"].miss_probability(1.0) > 0.25
    assert d.verdict.admitted and d.chosen.decode_pod == "d-safe"
    assert decide_pd([risky, safe], [], req(8000, objective=1.0), 10, params).chosen.decode_pod == "d-risky"


def test_the_predicted_decider_takes_the_path_admission_would_admit():
    """Remote is a little faster by the median but its prefill pod's predictions err widely (a 21 %
    risk of missing 0.5 s); local on the same decode pod is safe. The decider compared medians only,
    chose remote, and the request was refused although the decode pod could serve it."""
    d = DecodeView(candidate=Candidate(pod_id="d0", role="decode", queue_tokens=4000, overhead_s=0.005,
                                       log_error_sd=0.02), kv_capacity_tokens=100_000)
    p = Candidate(pod_id="p0", role="prefill", queue_tokens=2500, overhead_s=0.005, log_error_sd=0.4)
    params = PDParams(decider="predicted")
    got = decide_pd([d], [p], req(4000, objective=0.5), 100, params, miss_tolerance=0.1)
    o = got.ranked[0]
    assert o.remote.ttft_s < o.local.ttft_s < 0.5
    assert o.mode == "local" and got.verdict.admitted and "likely to meet" in o.reason
    # without an objective, or when the faster path is safe too, the medians decide as before
    assert decide_pd([d], [p], req(4000), 100, params, miss_tolerance=0.1).ranked[0].mode == "remote"
    safe = Candidate(pod_id="p0", role="prefill", queue_tokens=2500, overhead_s=0.005, log_error_sd=0.02)
    assert decide_pd([d], [safe], req(4000, objective=0.5), 100, params, miss_tolerance=0.1).ranked[0].mode == "remote"


def test_a_sidecar_duration_that_is_not_finite_is_ignored():
    """x-kvroute-prefill-ms of "inf" (or "1e400") made the prefill-leg histogram's sum infinite for good."""
    from prometheus_client import CollectorRegistry

    from router.disagg import pd_metrics, sidecar_prefill_seconds

    registry = CollectorRegistry()
    metrics = pd_metrics(registry)
    def told(ms: str) -> dict[str, str]:
        return {"x-kvroute-prefill": "remote", "x-kvroute-prefill-ms": ms}

    for raw in ("inf", "1e400", "-Infinity", "nan", "-5"):
        assert sidecar_prefill_seconds(told(raw), metrics, True) is None
    assert sidecar_prefill_seconds(told("12.5"), metrics, True) == 0.0125
    assert registry.get_sample_value("kvroute_pd_prefill_leg_seconds_sum") == 0.0125
