"""Review of ``kvroute demo`` and the routing trial (fleet/): bad flags are clear errors before anything
starts, the progress line prints nothing it did not measure, and the processes a demo or a trial
starts are stopped (by PID) on Ctrl-C, SIGTERM or a router that never became ready."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import fleet.trial
from fleet import demo


@pytest.fixture
def no_fleet(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The demo's trials and real engines replaced, so a flag that slipped through starts nothing."""
    calls: list[Any] = []

    def fake_trial(target: Any, *a: Any, **k: Any) -> dict[str, Any]:
        calls.append(target)
        return {"target": target, "summary": None, "records": [], "error": "not started in this test"}

    from realvllm import engines as rv

    def no_real() -> Any:
        calls.append("real")
        raise rv.RealVLLMUnavailable("not in this test")

    monkeypatch.setattr(fleet.trial, "run_trial", fake_trial)
    monkeypatch.setattr(rv, "find", no_real)
    return calls


@pytest.mark.parametrize("flags,needle", [
    (["--rate", "nan"], "--rate must be a finite number > 0"),
    (["--rate", "inf"], "--rate must be a finite number > 0"),
    (["--seconds", "nan"], "--seconds must be a finite number > 0"),
    (["--objective", "nan"], "--objective must be a finite number > 0"),
    (["--objective", "-1"], "--objective must be a finite number > 0"),
    (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s must be a finite number > 0"),
    (["--drain", "-1"], "--drain must be a finite number >= 0"),
    (["--system-prompts", "0"], "--system-prompts and --turn-tokens must be at least 1"),
    (["--turn-tokens", "0"], "--system-prompts and --turn-tokens must be at least 1"),
    (["--policies", "bogus"], "invalid choice: 'bogus'"),
    (["--real", "--real-rate", "0"], "--real-rate must be a finite number > 0"),
    (["--real", "--real-seconds", "-1"], "--real-seconds must be a finite number > 0"),
])
def test_demo_refuses_bad_flags_before_starting_anything(flags: list[str], needle: str, no_fleet: list[Any],
                                                         tmp_path: Path, capsys: Any) -> None:
    """Before: --rate nan / inf was a ValueError / OverflowError traceback; --objective nan, --drain -1 or
    --policies bogus (an empty table, exit 0) went ahead; --real --real-rate 0 started two vLLM engines."""
    with pytest.raises(SystemExit) as exc:
        demo.main(["--out", str(tmp_path), *flags])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert no_fleet == []


def test_demo_workload_too_large_is_a_clear_error(no_fleet: list[Any], tmp_path: Path, capsys: Any) -> None:
    """Before: a TraceError traceback from the workload generator."""
    assert demo.main(["--out", str(tmp_path), "--rate", "1e9", "--seconds", "1000"]) == 2
    assert "kvroute demo: error: multiturn: at most" in capsys.readouterr().out
    assert no_fleet == []


# e2e: it draws the run's plot, and matplotlib's first import on a machine builds its font cache by
# running fc-list (a child process), which a unit test may not start
@pytest.mark.e2e
def test_demo_progress_line_prints_a_dash_for_what_the_run_did_not_measure(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every request turned away, no pod counters: before, the line read "hit 0.0 %  p99 0.00 s"."""
    def all_rejected(target: Any, *a: Any, **k: Any) -> dict[str, Any]:
        summary = {"requests": 10, "rejected": 10, "errors": 0, "hit_rate": None, "ttft_p50": None,
                   "ttft_p99": None, "ttft_p99_all": float("inf"), "slo_attainment": 0.0, "admitted_late": 0.0}
        return {"target": target, "summary": summary, "records": [], "error": None}

    monkeypatch.setattr(fleet.trial, "run_trial", all_rejected)
    lines: list[str] = []
    args = demo.argparse.Namespace(rate=5.0, seconds=2.0, sessions=4, system_prompts=1, turn_tokens=100, pods=2,
                                   prefill_tokens_per_s=20000.0, objective=2.0, drain=1.0, policies=["random"],
                                   seed=0, out=str(tmp_path), json=None, real=False)
    assert demo.fleet_demo(args, out=lines.append) == 0
    progress = next(line for line in lines if line.lstrip().startswith("random "))
    assert "rejected 100.0 %" in progress
    assert "hit     - %" in progress and "p99      - s" in progress
    assert "0.00 s" not in progress and "hit   0.0 %" not in progress


def test_real_demo_stops_its_engines_when_their_start_is_interrupted(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Ctrl-C (or a start timeout) while the engines start: before, ``start_all`` sat outside the try,
    and both engines (each a process tree in a session of its own) were left running."""
    from realvllm import engines as rv

    stopped: list[Any] = []

    class FakeEngine:
        def __init__(self, env: Any, name: str, *a: Any, **k: Any) -> None:
            self.name = name
            self.url = f"http://127.0.0.1:1/{name}"

    def interrupted(engines: Any, *a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(rv, "find", lambda: SimpleNamespace(model=SimpleNamespace(name="tiny")))
    monkeypatch.setattr(rv, "Engine", FakeEngine)
    monkeypatch.setattr(rv, "start_all", interrupted)
    monkeypatch.setattr(rv, "stop_all", lambda engines, **k: stopped.extend(e.name for e in engines))
    args = demo.argparse.Namespace(out=str(tmp_path), seed=0, real_rate=6.0, real_seconds=1.0, real_objective=0.5,
                                   json=None, real=True)
    with pytest.raises(KeyboardInterrupt):
        demo.real_demo(args, out=lambda line: None)
    assert stopped == ["vllm-0", "vllm-1"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.e2e
def test_sigterm_to_the_demo_stops_the_pods_and_the_router_it_started(tmp_path: Path) -> None:
    """Before: a SIGTERM (a timeout, a CI cancel) ended the demo at once, and the ``kvroute sim`` and
    ``kvroute serve`` it had started, each in a session of its own, kept running."""
    from simulator.testing import process_tree, stop_process

    demo_proc = subprocess.Popen([sys.executable, "-m", "fleet.demo", "--pods", "1", "--rate", "2", "--seconds", "60",
                                  "--sessions", "2", "--turn-tokens", "50", "--drain", "1", "--policies", "random",
                                  "--out", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        # wait (bounded) until the pods and the router are up: the load is being replayed
        while time.monotonic() < deadline and demo_proc.poll() is None:
            children |= set(process_tree([demo_proc.pid])) - {demo_proc.pid}
            if (tmp_path / "logs" / "random.log").exists() and len(children) >= 2:
                time.sleep(1.0)
                children |= set(process_tree([demo_proc.pid])) - {demo_proc.pid}
                break
            time.sleep(0.2)
        assert demo_proc.poll() is None and len(children) >= 2, "the demo did not start its pods and router"
        demo_proc.send_signal(signal.SIGTERM)
        demo_proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.2)
        left = [p for p in children if _alive(p)]
        assert left == [], f"still running after the demo's SIGTERM: {left}"
    finally:
        for pid in children:  # a failed run leaves nothing behind: each child leads its own group
            if _alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        stop_process(demo_proc, grace=5.0)


@pytest.mark.e2e
def test_a_peer_router_that_never_becomes_ready_is_stopped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Before: only kvroute's own router processes were stopped when ``wait_ready`` gave up; a peer
    router (vllm-router, sglang-router) was left running."""
    from simulator.testing import stop_process

    venv = tmp_path / "peers"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "vllm-router"
    exe.write_text("#!/bin/sh\nexec sleep 120\n")
    exe.chmod(0o755)
    started: list[subprocess.Popen] = []
    real_spawn = fleet.trial.spawn

    def spawn(cmd: Any, log: Any = None, env: Any = None) -> subprocess.Popen:
        started.append(real_spawn(cmd, log, env))
        return started[-1]

    def never_ready(url: str, proc: Any = None, timeout: float = 30.0, **k: Any) -> None:
        assert proc is not None and proc.poll() is None
        raise TimeoutError(f"{url} did not answer (in this test, at once)")

    monkeypatch.setattr(fleet.trial, "spawn", spawn)
    monkeypatch.setattr(fleet.trial, "wait_ready", never_ready)
    try:
        with pytest.raises(TimeoutError):
            fleet.trial.start_router(fleet.trial.Target("peer", kind="vllm-router", policy="round_robin"),
                                     ["http://127.0.0.1:9"], 20000, fleet.trial.FleetSpec(pods=1), 2000.0, tmp_path,
                                     venv)
        assert len(started) == 1
        started[0].wait(timeout=15)   # stopped by start_router, not by us
        assert started[0].returncode is not None
    finally:
        for proc in started:
            stop_process(proc, grace=2.0)


@pytest.mark.e2e
def test_a_kvroute_in_front_of_real_engines_that_never_gets_healthy_pods_is_stopped(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``realvllm.fleet.start_kvroute`` (``demo --real``, ``bench/real_vllm.py``) raised when its pods
    never became healthy and left the ``kvroute serve`` it had started running."""
    import realvllm.fleet
    from simulator.testing import free_port, stop_process

    started: list[subprocess.Popen] = []
    real_spawn = realvllm.fleet.spawn

    def spawn(cmd: Any, log: Any = None, env: Any = None) -> subprocess.Popen:
        started.append(real_spawn(cmd, log, env))
        return started[-1]

    monkeypatch.setattr(realvllm.fleet, "spawn", spawn)
    dead = {"id": "engine", "url": f"http://127.0.0.1:{free_port()}", "model": "m"}  # nothing listens there
    try:
        with pytest.raises((TimeoutError, RuntimeError)):
            realvllm.fleet.start_kvroute([dead], tmp_path, "router", timeout=3.0)
        assert len(started) == 1
        started[0].wait(timeout=20)   # stopped by start_kvroute, not by us
        assert started[0].returncode is not None
    finally:
        for proc in started:
            stop_process(proc, grace=2.0)
