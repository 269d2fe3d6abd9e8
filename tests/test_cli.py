"""The one console command lists every subcommand, and settings layer file < env < flags."""

import os
import signal
import subprocess
import sys
import time

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvcommon.settings import load_settings
from router.cli import COMMANDS
from tests.helpers import ROOT


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "router.cli", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0
    for name in ("serve", "sidecar", "sim", "replay", "demo", "events"):
        assert name in COMMANDS
        assert name in out.stdout


def test_a_ctrl_c_ends_a_subcommand_with_one_line_and_code_130():
    """A terminal's Ctrl-C (SIGINT to the process group) in a long ``kvroute simulate``: one line
    naming the subcommand and the shell's code for an interrupt, not a stack trace."""
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "simulate", "--rate", "200", "--duration", "3600",
                             "--sessions", "2000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        time.sleep(4)  # imported and simulating: an hour of a 200 req/s workload takes minutes
        assert proc.poll() is None, proc.communicate()[1]
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "kvroute simulate: interrupted"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


class _Demo(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_TEST_", extra="forbid")
    port: int = Field(8000, description="port")
    name: str = Field("default", description="name")
    fast: bool = Field(False, description="fast")
    pods: list[str] = Field(default_factory=list, description="pods")


def test_settings_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("port: 9000\nname: file\npods: [a, b]\n")
    s = load_settings(_Demo, ["--config", str(cfg)], "t", "d")
    assert (s.port, s.name, s.pods) == (9000, "file", ["a", "b"])
    monkeypatch.setenv("KVROUTE_TEST_NAME", "env")
    s = load_settings(_Demo, ["--config", str(cfg)], "t", "d")
    assert s.name == "env" and s.port == 9000
    s = load_settings(_Demo, ["--config", str(cfg), "--name", "flag", "--fast", "--pods", '["c"]'], "t", "d")
    assert (s.name, s.fast, s.pods) == ("flag", True, ["c"])


def test_bad_config_file_is_a_clear_error(tmp_path, capsys):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("- just\n- a list\n")
    try:
        load_settings(_Demo, ["--config", str(cfg)], "t", "d")
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("a list at the top level must be refused")
    assert "mapping" in capsys.readouterr().err


def test_sigterm_lets_a_stream_run_for_the_shutdown_timeout_then_the_router_exits_cleanly(tmp_path):
    """``shutdown_timeout_s``: on SIGTERM the router stops accepting and lets a stream in flight run
    that long, then cuts it and exits (a Deployment's grace period is sized above it).
    Without it uvicorn waited for the stream to end, however long, until a SIGKILL came."""
    import httpx
    import yaml

    from simulator.testing import running_sims
    from tests.helpers import free_port, kvroute_process

    # one output token every 5 s: the stream outlasts the test by far
    with running_sims(1, ["--timing", "seed", "--decode-s-per-token", "5"]) as urls:
        port = free_port()
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"port": port, "shutdown_timeout_s": 1,
                                       "pods": [{"id": "sim-0", "url": urls[0], "model": "sim-model"}]}))
        base = f"http://127.0.0.1:{port}"
        with kvroute_process(["serve", "--config", str(cfg)], ready_url=base + "/ready", timeout=40) as proc:
            body = {"model": "sim-model", "prompt": "a long answer", "max_tokens": 200, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # the stream is running
                proc.send_signal(signal.SIGTERM)
                # uvicorn, its shutdown done, raises the signal again: the exit a supervisor expects
                assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
