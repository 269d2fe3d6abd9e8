"""Review of ``kvroute simulate`` / ``kvroute plan``: bad input is a clear error, a request no pod can
hold ends the run instead of looping for ever, and what went unanswered shows in the table.

Every loop these tests drive is bounded in count (``_bounded``): on a tree without the fixes the
over-long request preempted itself for ever, and the test fails instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from whatif.cli import format_rows
from whatif.cli import main as simulate_main
from whatif.plan import main as plan_main
from whatif.podmodel import PodModel, PodSpec, _ForwardCore
from whatif.simulate import SimConfig, simulate

SMALL = ["multiturn", "--sessions", "4", "--turns", "2", "--rate", "10", "--duration", "1"]


@dataclass
class Spec:
    token_ids: list[int]
    output_len: int


@pytest.fixture
def _bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail, instead of spinning for ever, once the pods or a forward run have stepped 20,000 times."""
    steps = [0]

    def guard(orig: Any) -> Any:
        def wrapped(self: Any, now: float) -> Any:
            steps[0] += 1
            if steps[0] > 20000:
                raise RuntimeError("more than 20,000 steps: the simulation does not end")
            return orig(self, now)
        return wrapped

    monkeypatch.setattr(PodModel, "start_step", guard(PodModel.start_step))
    monkeypatch.setattr(_ForwardCore, "schedule", guard(_ForwardCore.schedule))


@pytest.mark.parametrize("flags,needle", [
    (["--pods", "0"], "--pods must be at least 1"),
    (["--num-gpu-blocks", "0"], "--num-gpu-blocks must be at least 1"),
    (["--timing", "cost", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["--timing", "cost", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1"),
    (["--slo-ttft", "nan"], "--slo-ttft must be a finite number > 0"),
    (["--slo-ttft", "-1"], "--slo-ttft must be a finite number > 0"),
    (["--slo-tpot", "nan"], "--slo-tpot must be a finite number > 0"),
    (["--event-delay-ms", "-5"], "--event-delay-ms must be a finite number >= 0"),
    (["--request-latency-ms", "nan"], "--request-latency-ms must be a finite number >= 0"),
    (["--decode-s-per-token", "-1"], "--decode-s-per-token must be a finite number >= 0"),
    (["--policy", ","], "--policy names no policy"),
])
def test_simulate_refuses_bad_numbers_with_a_clear_message(flags: list[str], needle: str, capsys: Any) -> None:
    """Before: --pods 0 was a traceback (APIError: the model does not exist), --num-gpu-blocks 0 a
    ZeroDivisionError, --slo-ttft nan printed 100 % met and -1 0 %, --policy , an empty table, rc 0."""
    args = SMALL + (["--policy", "random"] if "--policy" not in flags else []) + flags
    assert simulate_main(args) == 2
    err = capsys.readouterr().err
    assert f"kvroute simulate: error: {needle}" in err


@pytest.mark.parametrize("flags,needle", [
    (["--decider", ","], "--decider names no P/D decider"),
    (["--policy", "oracle"], "--policy 'oracle': choose from"),
    (["--policy", "true-state"], "--policy 'true-state': choose from"),
    (["--num-gpu-blocks", "0"], "--num-gpu-blocks must be at least 1"),
    (["--slo-tpot", "nan"], "--slo-tpot must be a finite number > 0"),
])
def test_plan_refuses_bad_input_before_simulating_anything(flags: list[str], needle: str, capsys: Any) -> None:
    """Before: --decider , recommended the aggregated fleet out of a field of one; --policy oracle ran the
    aggregated candidate, then failed on the first P/D one; --num-gpu-blocks 0 was a traceback."""
    assert plan_main(SMALL + flags) == 2
    captured = capsys.readouterr()
    assert f"kvroute plan: error: {needle}" in captured.err
    assert "met" not in captured.err and captured.out == ""   # no candidate was simulated first


@pytest.mark.parametrize("policy,admission", [("random", False), ("predicted-ttft", True), ("oracle", False),
                                              ("true-state", True)])
def test_a_request_longer_than_a_cost_pods_kv_cache_is_refused_and_the_run_ends(
        policy: str, admission: bool, _bounded: None) -> None:
    """2,300 prompt tokens + 200 output on a pod of 150 blocks of 16 (2,400 tokens), 64-token steps:
    before, once its output ran the blocks out it preempted itself, re-admitted from its cached prefix
    and did it again, for ever (simulated time grew without end). vLLM caps max_model_len at what
    its cache holds and answers such a request 400; so does the pod model now."""
    spec = PodSpec(timing="cost", block_size=16, num_gpu_blocks=150, max_num_batched_tokens=64)
    specs = [Spec(list(range(100, 200)), 4), Spec(list(range(1000, 3300)), 200), Spec(list(range(100, 220)), 4)]
    res = simulate(specs, [0.0, 0.01, 0.02], SimConfig(policy=policy, admission=admission, objective_s=30.0, pods=2,
                                                       spec=spec))
    by_index = {r.index: r for r in res.records}
    big = by_index[1]
    if big.status == 429:       # admission may turn it away first: a rejection, not a loop either
        assert admission
    else:
        assert big.status == 400 and "KV cache" in (big.error or "")
    assert by_index[0].status == 200 and by_index[2].status == 200
    assert res.summary["failed"] == 1


def test_requests_a_pod_never_answers_are_errors_in_the_record_and_the_table() -> None:
    """A cost pod that can run nothing (max_num_seqs 0, from the library) leaves every request unanswered:
    the records say so, and the table's "met" column counts them, as the demo's does."""
    spec = PodSpec(timing="cost", block_size=16, num_gpu_blocks=100, max_num_seqs=0)
    res = simulate([Spec(list(range(50)), 2)] * 3, [0.0, 0.1, 0.2], SimConfig(policy="random", pods=1, spec=spec))
    assert res.summary["errors_by_status"] == {"unanswered": 3}
    table = format_rows([("random", res.summary)], 2.0)
    assert "| 0.0 % [3 errors] |" in table


@pytest.mark.parametrize("main,expected", [
    (plan_main, ["every candidate has this many pods (default: 4)", "chunked prefill (default: cost)",
                 "tokens per KV block (default: 16)", "KV blocks per pod (default: 8192)"]),
    (simulate_main, ["pods in the fleet (default: 8)", "chunked prefill (default: seed)",
                     "tokens per KV block (default: 64)", "KV blocks per pod (default: 3000)"]),
])
def test_help_states_each_default_once_and_the_one_that_applies(main: Any, expected: list[str], capsys: Any) -> None:
    """Before, ``kvroute plan --help`` said "tokens per KV block (default: 64) (default: 16)" and "(default:
    seed) (default: cost)": the shared help text named kvroute simulate's defaults, the formatter plan's."""
    import re

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"\(default: [^)]*\) \(default:", text) is None
    for phrase in expected:
        assert phrase in text
