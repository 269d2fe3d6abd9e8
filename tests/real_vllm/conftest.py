"""Real vLLM engines (CPU build) for the ``real_vllm`` tests, started once per session and shared.

Start-up costs 25-55 s an engine, so engines are shared and every test that needs them asks for a
fixture: ``agg_engines`` (two aggregated engines with KV events and replay, a small KV cache so
eviction is reachable; shared by the whole session) and ``pd_engines`` (a prefill and a decode
engine joined by NIXL; one test module). The two pairs never run at once: an idle NIXL engine keeps
two threads polling (its worker's loop and NIXL's progress thread, about 70 % of a core each, seen
with top -H and strace), so the aggregated pair is stopped while the NIXL pair runs, and the P/D
module runs last of this tier (``pytest_collection_modifyitems``) so that nothing starts it again.
The real-vLLM environment must be built (``make real-vllm``; ``make test``
builds it): when it is missing these tests fail with that instruction, they are never skipped.
Deselect them with ``-m "not real_vllm"``.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from realvllm import engines as rv
from simulator.testing import spawn, stop_process, wait_ready
from tests.helpers import free_port, http
from tests.helpers import metric as engine_metric  # noqa: F401 - an engine's samples, by vLLM's names

# 256 blocks of 32 tokens: 8,192 tokens of KV cache per engine, so a test can force eviction
AGG_BLOCKS = 256


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    real = [i for i, item in enumerate(items) if here in Path(str(item.fspath)).parents]
    for i in real:
        items[i].add_marker(pytest.mark.real_vllm)
        items[i].add_marker(pytest.mark.timeout(600))
    # the data-parallel engine's tests, then the NIXL pair's, last in this tier: the aggregated pair is
    # stopped for each of them and so is not wanted again
    for fixture in ("dp_engine", "pd_engines"):
        moved = [items[i] for i in real if fixture in getattr(items[i], "fixturenames", ())]
        if not moved:
            continue
        for item in moved:
            items.remove(item)
        last = max((i for i, item in enumerate(items) if here in Path(str(item.fspath)).parents),
                   default=len(items) - 1)
        items[last + 1:last + 1] = moved
        real = [i for i, item in enumerate(items) if here in Path(str(item.fspath)).parents]


@pytest.fixture(scope="session")
def real_env() -> rv.RealEnv:
    try:
        return rv.find()
    except rv.RealVLLMUnavailable as exc:
        pytest.fail(f"{exc} (or deselect these tests with -m 'not real_vllm')", pytrace=False)


# the session's scratch folder while it exists, for the failure report below
_scratch: list[Path] = []
LOG_TAIL_CHARS = 4000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed real-vLLM test reports the tail of every engine's log: the folder is removed when the
    session ends, and CI keeps only what pytest printed (twice a NIXL decode never answered in CI and
    the logs that could have said why were gone)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and report.when == "call" and _scratch:
        for log in sorted(_scratch[0].glob("*.log")):
            report.sections.append((f"engine log {log.name}, last {LOG_TAIL_CHARS} characters",
                                    log.read_text(errors="replace")[-LOG_TAIL_CHARS:]))


@pytest.fixture(scope="session")
def real_scratch() -> Iterator[Path]:
    """The engines' logs and scratch files: a folder of their own, not pytest's rotating tmp folders
    (a later pytest session removes the oldest of those, under engines still running from it)."""
    path = Path(tempfile.mkdtemp(prefix="kvroute-real-vllm-"))
    _scratch.append(path)
    try:
        yield path
    finally:
        _scratch.remove(path)
        shutil.rmtree(path, ignore_errors=True)


class _AggPair:
    """The aggregated pair, started on first use and stopped while the NIXL pair runs."""

    def __init__(self) -> None:
        self.engines: list[rv.Engine] = []

    def get(self, real_env: rv.RealEnv, scratch: Path) -> list[rv.Engine]:
        if not self.engines:
            engines = [rv.Engine(real_env, f"agg-{i}", scratch, core=i, num_gpu_blocks=AGG_BLOCKS, dev_mode=True,
                                 responses_store=True, extra_args=["--enable-scale-out"]) for i in range(2)]
            rv.start_all(engines)
            self.engines = engines
        return self.engines

    def stop(self) -> None:
        engines, self.engines = self.engines, []
        rv.stop_all(engines)


@pytest.fixture(scope="session")
def _agg_pair() -> Iterator[_AggPair]:
    pair = _AggPair()
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def agg_engines(_agg_pair: _AggPair, real_env: rv.RealEnv, real_scratch: Path) -> list[rv.Engine]:
    """Two aggregated engines, one core each, KV events with replay, 256 KV blocks each, dev mode on
    (``/reset_prefix_cache``), the Responses API's store on, the scale-out routes on (render and
    token-in generation: ``--enable-scale-out``); the same two for every test, unless the NIXL pair
    ran in between."""
    return _agg_pair.get(real_env, real_scratch)


@pytest.fixture(scope="module")
def pd_engines(_agg_pair: _AggPair, real_env: rv.RealEnv, real_scratch: Path) -> Iterator[list[rv.Engine]]:
    """A prefill engine (core 0) and a decode engine (core 1) joined by NIXL, both with KV events.

    Module-scoped, and the aggregated pair is stopped first: an idle NIXL engine keeps two threads
    polling, which would slow every other test."""
    _agg_pair.stop()
    engines = [rv.Engine(real_env, name, real_scratch, core=i, nixl=True, extra_args=["--enable-scale-out"])
               for i, name in enumerate(("prefill", "decode"))]
    with rv.running(engines):
        yield engines


# ---------------------------------------------------------------------------------------------
# the router (and sidecars) in front of real engines
# ---------------------------------------------------------------------------------------------

# how long a router or sidecar process may take to answer: about 2 s on a quiet machine, but CI machines
# run the engines' busy threads beside it, and a 2-core machine six times oversubscribed took over 30 s
# just to import (an upper bound only: a healthy start does not wait for it)
START_TIMEOUT_S = 120.0


def wait_for(predicate, timeout: float = 10.0, what: str = "condition", interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(interval)


@contextlib.contextmanager
def running_router(tmp_path: Path, pods: list[dict[str, Any]], **settings: Any) -> Iterator[str]:
    """``kvroute serve`` (a child process, stopped by PID, its log ``tmp_path/router-<port>.log``) in
    front of ``pods``; yields its base URL once every pod is healthy (with ``api_keys``, once it is
    ready: its /ready then gives no pod count)."""
    port = free_port()
    cfg = tmp_path / f"router-{port}.yaml"
    cfg.write_text(yaml.safe_dump({"port": port, "pods": pods, "scrape_interval_s": 0.2, "health_interval_s": 0.5,
                                   "log_level": "info", **settings}))
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / f"router-{port}.log"
    proc = spawn([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)], log)
    try:
        wait_ready(base + "/ready", proc, START_TIMEOUT_S, log=log)
        # a data-parallel pod is one routable unit per engine (each with its own event stream)
        units = sum(p.get("data_parallel_size") or max(1, len(p.get("kv_events") or ())) for p in pods)
        if not settings.get("api_keys"):
            wait_for(lambda: http().get(base + "/ready", timeout=10).json().get("healthy_pods") == units,
                     START_TIMEOUT_S, "every pod healthy")
        yield base
    except BaseException:
        print(f"---- router log ({log}), last lines:\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        stop_process(proc)


def debug_route(base: str, body: dict[str, Any], route: str | None = None) -> dict[str, Any]:
    """The router's decision for ``body`` (as the request of ``route``, a generation path, when given)."""
    r = http().post(base + "/debug/route", json=body, params={"route": route} if route else None)
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(base: str, body: dict[str, Any], pod: str) -> int:
    """What the router believes ``pod`` holds of ``body``'s prompt (every tier)."""
    row = next(p for p in debug_route(base, body)["pods"] if p["pod"] == pod)
    return int(sum(row["cached_tokens_by_tier"].values()))


def wait_indexed(base: str, body: dict[str, Any], pod: str, stored_tokens: int, timeout: float = 15.0) -> int:
    """Wait until the router credits ``body`` on ``pod`` with the blocks of an earlier prompt of
    ``stored_tokens`` tokens (all its full blocks but the last, whose tokens a follow-up may split
    differently at the join); returns the credit then.

    A credit above zero is not enough: an engine prefills a prompt longer than one step's budget (2,048
    tokens on CPU) over several steps, and announces each step's blocks when that step is scheduled, so
    the index can be read between two steps' events. Waiting for a credit above zero once read 2,048 of
    a 2,624-token hit."""
    need = max(1, stored_tokens // rv.BLOCK_SIZE - 1) * rv.BLOCK_SIZE
    wait_for(lambda: cached_tokens(base, body, pod) >= need, timeout,
             f"{pod} credited with at least {need} of the {stored_tokens} tokens stored")
    return cached_tokens(base, body, pod)

