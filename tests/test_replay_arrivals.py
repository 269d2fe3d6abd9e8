"""Arrival processes: seeded, rates within statistical bounds, trace scaling and limits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay import arrivals


def _gaps(offsets):
    return np.diff(np.asarray(offsets))


def test_poisson_rate_and_dispersion_within_bounds():
    n, rate = 20_000, 50.0
    offs = arrivals.poisson(n, rate, seed=1)
    assert offs[0] == 0.0 and all(b >= a for a, b in zip(offs, offs[1:]))
    gaps = _gaps(offs)
    # mean gap 1/rate within 5 standard errors (sd of an exponential gap = its mean)
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(len(gaps))
    cv = gaps.std() / gaps.mean()
    assert 0.95 < cv < 1.05
    # counts in 1 s windows are Poisson: variance close to the mean
    counts = np.bincount(np.asarray(offs, dtype=int))[:-1]
    assert 0.85 < counts.var() / counts.mean() < 1.15


def test_seeded_schedules_repeat_and_differ_by_seed():
    assert arrivals.poisson(100, 5.0, seed=7) == arrivals.poisson(100, 5.0, seed=7)
    assert arrivals.poisson(100, 5.0, seed=7) != arrivals.poisson(100, 5.0, seed=8)
    assert arrivals.gamma(100, 5.0, 0.5, seed=7) == arrivals.gamma(100, 5.0, 0.5, seed=7)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_rate_and_burstiness(burstiness):
    n, rate = 20_000, 20.0
    gaps = _gaps(arrivals.gamma(n, rate, burstiness, seed=3))
    assert abs(gaps.mean() * rate - 1) < 0.05
    expected_cv = 1 / math.sqrt(burstiness)
    assert abs(gaps.std() / gaps.mean() - expected_cv) < 0.08 * expected_cv


def test_constant_rate_is_exact():
    offs = arrivals.constant(5, 4.0)
    assert offs == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_trace_timestamps_scaled_and_shifted():
    assert arrivals.from_trace([10.0, 11.0, 13.0], time_scale=0.5) == [0.0, 0.5, 1.5]
    with pytest.raises(ValueError, match="no timestamps"):
        arrivals.schedule("trace", 2, timestamps=[None, None])


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="--rate"):
        arrivals.schedule("poisson", 3)
    with pytest.raises(ValueError, match="--burstiness"):
        arrivals.gamma(3, 1.0, 0.0)
    with pytest.raises(ValueError, match="--time-scale"):
        arrivals.from_trace([0.0], time_scale=0)
    with pytest.raises(ValueError, match="unknown arrival"):
        arrivals.schedule("zipf", 3, rate=1.0)


def test_cut_by_duration_and_max_requests():
    offs = [0.0, 0.5, 1.0, 1.5, 2.0]
    assert arrivals.cut(offs, duration=1.0) == 2  # sent strictly before the duration
    assert arrivals.cut(offs, max_requests=3) == 3
    assert arrivals.cut(offs, duration=10, max_requests=4) == 4
    assert arrivals.cut(offs) == 5
