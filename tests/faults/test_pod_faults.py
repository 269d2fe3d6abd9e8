"""Pod faults through real processes: a pod killed mid-stream, a pod failing before the first byte,
a pod slowed down ten times."""

from __future__ import annotations

import pytest

from tests.faults import scenarios

pytestmark = pytest.mark.timeout(90)


async def test_pod_killed_mid_stream_ends_streams_cleanly_leaves_and_returns(tmp_path):
    row = await scenarios.pod_killed(tmp_path)
    f = row.figures
    # streams on the killed pod end with an error event and [DONE]; the others complete
    assert set(f["mid_stream"]) == {"victim-0", "live-0"}, f
    assert f["mid_stream"]["victim-0"] == "error-event" and f["mid_stream"]["live-0"] == "ok", f
    assert not [k for k in f["kinds"] if k not in ("ok", "error-event")], f["kinds"]  # nothing truncated or hung
    assert row.sent == row.answered
    # it leaves the candidate set within one health interval (0.5 s) plus a check's timeout (0.5 s)
    assert f["left_candidates_s"] is not None and f["left_candidates_s"] < 1.5, f
    assert f["while_dead"] == [("ok", "live-0")], f
    # and comes back once it answers its health checks again
    assert f["returned_s"] is not None and f["returned_s"] < 8, f
    assert "victim-0" in f["after_return_pods"], f


async def test_pod_failing_before_the_first_byte_is_retried_on_another_pod(tmp_path):
    row = await scenarios.fails_before_first_byte(tmp_path, requests=12)
    assert row.figures["kinds"] == {"ok": 12}, row.figures
    assert row.figures["pods"] == ["sim-1"]  # every answer came from the healthy pod
    assert row.figures["retries"] >= 6  # round-robin put half of them on the failing pod first


async def test_slow_pod_loses_its_traffic_and_its_predictions_say_why(tmp_path):
    row = await scenarios.slow_pod(tmp_path, requests=30)
    f = row.figures
    assert row.sent == row.answered == 40
    assert f["share_after"] <= 0.2 < f["share_before"] + 0.01, f
    pred = f["predicted_ttft_ms"]
    assert pred["sim-0"] > 1.5 * pred["sim-1"], f  # learnt from the few requests it got before routing moved
    # the calibration says why: a slower prefill rate or a longer fixed part (with chunked prefill and
    # cache hits the fit may put a slowdown of every step in either, depending on the requests seen)
    rate, over = f["prefill_tokens_per_s"], f["overhead_ms"]
    assert rate["sim-0"] < rate["sim-1"] / 1.5 or over["sim-0"] > 1.5 * over["sim-1"] + 5, f
    assert f["chosen"] == "sim-1"


async def test_openai_sdk_sees_a_broken_stream_as_an_api_error_not_a_hang(tmp_path):
    """The official client: a pod dropping its connection mid-stream surfaces as ``openai.APIError``
    carrying the router's message, after the chunks that did arrive."""
    import openai

    from tests.faults.harness import Sims, router, sim_faults

    with Sims(1, ["--timing", "seed", "--decode-s-per-token", "0.01"], events=False) as sims:
        sim_faults(sims.urls[0], drop_after_chunks=3)
        with router(tmp_path, sims.pods()) as r:
            client = openai.AsyncOpenAI(base_url=r.base + "/v1", api_key="unused", max_retries=0, timeout=20)
            got = []
            with pytest.raises(openai.APIError) as caught:
                stream = await client.completions.create(model="sim-model", prompt="hello there", max_tokens=20,
                                                         stream=True)
                async for chunk in stream:
                    got.append(chunk.choices[0].text if chunk.choices else "")
            assert "upstream stream failed" in str(caught.value.message)
            assert len(got) >= 1  # the chunks before the break were delivered
            await client.close()
