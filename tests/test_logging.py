"""Logs a log pipeline can read: ``log_format: json`` writes one JSON object per line (``ts``, ``level``,
``logger``, ``pid``, ``msg``, ``exc``) from the router, its worker processes, uvicorn and the sidecar, for
any message; and a bad ``log_level`` or ``log_format`` is a one-line error at start, not a traceback."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from pydantic import ValidationError

from kvcommon.logs import JsonFormatter, json_hooks, logging_config
from kvcommon.settings import build_settings, load_settings
from router.config import RouterSettings
from sidecar.config import SidecarSettings
from simulator.settings import SimSettings
from simulator.testing import running_sims, stop_process, wait_ready
from tests.helpers import ROOT, free_port

KEYS = {"ts", "level", "logger", "pid", "msg"}
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(msg: str, *args: Any, name: str = "kvroute.test", level: int = logging.WARNING,
           exc_info: Any = None) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args or None, exc_info)


def one_json_line(line: str) -> dict[str, Any]:
    """``line`` is exactly one line, however lines are split, and strict JSON (orjson refuses lone surrogates)."""
    assert "\n" not in line and "\r" not in line and len(line.splitlines()) == 1, line
    obj = orjson.loads(line)
    assert obj == json.loads(line)
    return obj


# ---------------------------------------------------------------------------------------------
# The formatter
# ---------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_a_record_is_one_json_object_with_time_level_logger_and_the_formatted_message():
    rec = record("pod %s unhealthy for %.0fs", "p0", 30.0, name="kvroute.pods")
    obj = one_json_line(JsonFormatter().format(rec))
    assert set(obj) == KEYS
    assert (obj["level"], obj["logger"], obj["msg"], obj["pid"]) == ("WARNING", "kvroute.pods",
                                                                     "pod p0 unhealthy for 30s", os.getpid())
    assert TS.match(obj["ts"]), obj["ts"]
    assert obj["ts"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(rec.created)) + f".{int(rec.msecs):03d}Z"


@pytest.mark.unit
def test_a_traceback_goes_in_exc_on_the_same_line():
    try:
        {}["missing"]
    except KeyError:
        rec = record("lookup failed", exc_info=sys.exc_info())
    obj = one_json_line(JsonFormatter().format(rec))
    assert obj["msg"] == "lookup failed"
    assert obj["exc"].startswith("Traceback (most recent call last):") and "KeyError: 'missing'" in obj["exc"]
    assert "\n" in obj["exc"]  # the traceback's own lines, escaped inside the one line
    rec = record("with a stack")
    rec.stack_info = "Stack (most recent call last):\n  File x"
    assert one_json_line(JsonFormatter().format(rec))["stack"].startswith("Stack")


NASTY = ('line one\nline two\r\n"quoted" \\backslash\t\x00\x1b[31m {"json": true} \u2028\u2029\x85 é 雪 🚀 '
         'bytes \udcff\udc80 and a lone \ud800')


@pytest.mark.unit
def test_any_message_stays_one_valid_json_line():
    """Newlines, quotes, control characters, Unicode line separators, and lone surrogates (bytes decoded
    with surrogateescape, as a client's path or header can be), in the message, its arguments and the
    logger's name."""
    for rec in (record(NASTY), record("got %s from %r", NASTY, NASTY.encode("utf-8", "surrogatepass")),
                record("plain", name="kvroute.\udcff\n")):
        line = JsonFormatter().format(rec)
        obj = one_json_line(line)
        assert set(obj) == KEYS
    obj = one_json_line(JsonFormatter().format(record(NASTY)))
    clean = NASTY.split(" bytes ")[0]
    assert obj["msg"].startswith(clean)  # everything but the surrogates comes back as it was
    assert obj["msg"].endswith("bytes \\udcff\\udc80 and a lone \\ud800")  # those as their escapes, as text
    line = JsonFormatter().format(record("no surrogates: \u2028"))
    assert "\\u2028" in line and one_json_line(line)["msg"] == "no surrogates: \u2028"


@pytest.mark.unit
def test_a_log_call_whose_arguments_do_not_fit_is_still_one_json_line():
    obj = one_json_line(JsonFormatter().format(record("two %s %s", "only-one")))
    assert obj["msg"].startswith("two %s %s") and "TypeError" in obj["msg"]


@pytest.mark.unit
def test_json_config_formats_every_handler_as_json_and_keeps_the_access_log_redacted():
    config = logging_config("info", "json")
    assert {f.get("()") for f in config["formatters"].values()} == {"kvcommon.logs.JsonFormatter"}
    assert config["handlers"]["access"]["filters"] == ["redact_query"]
    assert config["root"] == {"level": "INFO", "handlers": ["kvroute"]}
    text = logging_config("WARNING", "text")
    assert text["formatters"]["default"]["()"] == "uvicorn.logging.DefaultFormatter"
    assert text["formatters"]["kvroute"]["format"] == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    assert text["root"]["level"] == "WARNING"


@pytest.mark.unit
def test_in_json_uncaught_exceptions_and_warnings_are_logged_not_printed(monkeypatch):
    """Python prints an uncaught exception's traceback and a warning to stderr as bare text lines; in JSON
    they go through logging."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored afterwards
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    for name in ("kvroute", "py.warnings"):
        monkeypatch.setattr(logging.getLogger(name), "handlers", [handler])
        monkeypatch.setattr(logging.getLogger(name), "propagate", False)
    try:
        json_hooks()
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())
        thread = threading.Thread(target=lambda: 1 / 0, name="worker-7")
        thread.start()
        thread.join()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
    lines = [one_json_line(JsonFormatter().format(r)) for r in seen]
    assert [(x["level"], x["msg"]) for x in lines[:2]] == [("CRITICAL", "uncaught exception"),
                                                           ("ERROR", "uncaught exception in thread worker-7")]
    assert "RuntimeError: boom" in lines[0]["exc"] and "ZeroDivisionError" in lines[1]["exc"]
    assert lines[2]["logger"] == "py.warnings" and "DeprecationWarning: deprecated thing" in lines[2]["msg"]


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_every_service_has_a_log_format_setting_text_by_default():
    for cls, env in ((RouterSettings, "KVROUTE_LOG_FORMAT"), (SidecarSettings, "KVROUTE_SIDECAR_LOG_FORMAT"),
                     (SimSettings, "KVROUTE_SIM_LOG_FORMAT")):
        assert cls.model_fields["log_format"].default == "text", cls
        assert load_settings(cls, ["--log-format", "json"], "t", "d").log_format == "json"
        assert cls.model_config.get("env_prefix", "") + "LOG_FORMAT" == env
    assert build_settings(RouterSettings, file_data={"log_format": "json"}).log_format == "json"


@pytest.mark.unit
def test_the_routers_log_level_is_one_of_four_in_any_case(monkeypatch):
    assert build_settings(RouterSettings).log_level == "warning"
    assert load_settings(RouterSettings, ["--log-level", "INFO"], "t", "d").log_level == "info"
    assert build_settings(RouterSettings, file_data={"log_level": "Debug"}).log_level == "debug"
    monkeypatch.setenv("KVROUTE_LOG_LEVEL", "ERROR")
    assert build_settings(RouterSettings).log_level == "error"
    monkeypatch.delenv("KVROUTE_LOG_LEVEL")
    for bad in ("verbose", 7, "", "warn", None):
        with pytest.raises(ValidationError, match="log_level"):
            build_settings(RouterSettings, file_data={"log_level": bad})
    with pytest.raises(ValidationError, match="log_format"):
        build_settings(RouterSettings, file_data={"log_format": "xml"})


def refused(main: Callable[[list[str]], int], argv: list[str], capsys) -> str:
    """``main(argv)`` exits with code 2 and one error line (after argparse's usage); that line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


PODS = ["--pods", '[{"id": "p0", "url": "http://127.0.0.1:9", "model": "m"}]', "--port", "1"]


@pytest.mark.unit
def test_a_bad_log_level_or_format_is_a_one_line_error_and_exit_code_2(tmp_path, monkeypatch, capsys):
    """Until this was checked, ``kvroute serve --log-level verbose`` died in ``logging.basicConfig``
    with a ValueError traceback (exit code 1)."""
    from router.serve import main as serve
    from sidecar.cli import main as sidecar
    from simulator.cli import main as sim

    line = refused(serve, [*PODS, "--log-level", "verbose"], capsys)
    assert line == "kvroute serve: error: log_level: Value error, expected one of debug, info, warning, error"
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"log_level": 7}))
    assert "log_level" in refused(serve, [*PODS, "--config", str(cfg)], capsys)
    monkeypatch.setenv("KVROUTE_LOG_LEVEL", "trace")
    assert "log_level" in refused(serve, PODS, capsys)
    monkeypatch.delenv("KVROUTE_LOG_LEVEL")
    for main, prog in ((serve, "serve"), (sidecar, "sidecar"), (sim, "sim")):
        line = refused(main, [*(PODS if main is serve else []), "--log-format", "xml"], capsys)
        assert line == (f"kvroute {prog}: error: argument --log-format: invalid choice: 'xml' "
                        "(choose from 'text', 'json')")


# ---------------------------------------------------------------------------------------------
# The shipped Kubernetes config
# ---------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_kubernetes_config_logs_json():
    kube = ROOT / "deploy" / "kubernetes"
    for path in [kube / "base" / "router.yaml", *sorted(kube.glob("overlays/*/router.yaml"))]:
        assert yaml.safe_load(path.read_text()).get("log_format") == "json", path
    for path, name in ((kube / "overlays" / "vllm-pd" / "decode.yaml", "sidecar"),
                       (kube / "overlays" / "simulated" / "sim.yaml", "sim")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
                args = next(c["args"] for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name)
                assert args[args.index("--log-format") + 1] == "json", path


# ---------------------------------------------------------------------------------------------
# Real processes
# ---------------------------------------------------------------------------------------------

@contextmanager
def kvroute(args: list[str], tmp: Path) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """``kvroute ARGS`` with its stdout and stderr in files of their own; stopped (SIGTERM to its group)
    at the end."""
    out, err = tmp / "stdout", tmp / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "router.cli", *args], cwd=ROOT, stdout=o, stderr=e,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        yield proc, out, err
    finally:
        stop_process(proc)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path``, each one JSON object with the fields (a line being written may lack its end)."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    done = lines[:-1]  # the last is "" once complete, else a line still being written
    bad = [line for line in done if not _is_record(line)]
    assert not bad, f"{path.name}: lines that are not JSON records: {bad[:5]}"
    return [json.loads(line) for line in done]


def _is_record(line: str) -> bool:
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and KEYS <= set(obj) and bool(TS.match(obj["ts"]))


def wait_for(path: Path, pred: Callable[[list[dict[str, Any]]], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred(json_lines(path)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {path.read_text()[-3000:]}"
        time.sleep(0.1)


def pids_saying(records: list[dict[str, Any]], logger: str, msg: str) -> set[int]:
    return {r["pid"] for r in records if r["logger"] == logger and r["msg"] == msg}


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [1, 2])
def test_serve_with_json_logs_writes_only_json_lines_its_own_uvicorns_and_its_workers(tmp_path, workers):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as pod:
        urls = pod.enter_context(running_sims(1))
        pods = json.dumps([{"id": "p0", "url": urls[0], "model": "sim-model"}])
        args = ["serve", "--port", str(port), "--pods", pods, "--workers", str(workers), "--log-format", "json",
                "--log-level", "info", "--access-log", "--health-interval-s", "0.2", "--unhealthy-after", "1"]
        with kvroute(args, tmp_path) as (proc, out, err):
            wait_ready(base + "/ready", proc, timeout=60, log=err)
            # every worker has checked its pod (a line the router logs itself, in each process)
            wait_for(err, lambda rs: len(pids_saying(rs, "kvroute.pods", "pod p0 is now healthy")) == workers,
                     "every worker's healthy pod")
            assert httpx.get(base + "/health?api_key=do-not-log-me", trust_env=False).status_code == 200
            pod.close()  # the simulated pod goes away
            wait_for(err, lambda rs: len(pids_saying(rs, "kvroute.pods", "pod p0 is now unhealthy")) == workers,
                     "every worker's unhealthy pod")
            wait_for(out, lambda rs: any("/health" in r["msg"] for r in rs), "the access log line")
    logged = json_lines(err)
    assert err.read_text().endswith("\n")
    msgs = [r["msg"] for r in logged]
    assert any(m.startswith("Uvicorn running on http://127.0.0.1:") for m in msgs)
    assert "Application startup complete." in msgs and any(m.startswith("Finished server process") for m in msgs)
    assert {r["logger"] for r in logged} >= {"uvicorn.error", "kvroute.pods"}
    if workers > 1:
        assert any(m.startswith("Started parent process") for m in msgs)
        worker_pids = pids_saying(logged, "kvroute.pods", "pod p0 is now unhealthy")
        assert len(worker_pids) == 2 and proc.pid not in worker_pids
        assert len(pids_saying(logged, "uvicorn.error", "Application startup complete.")) == 2
    access = [r for r in json_lines(out) if r["logger"] == "uvicorn.access"]
    assert access and all(r["level"] == "INFO" for r in access)
    assert any(r["msg"].endswith('"GET /health?<redacted> HTTP/1.1" 200') for r in access)
    assert "do-not-log-me" not in out.read_text() + err.read_text()


@pytest.mark.e2e
def test_sidecar_with_json_logs_writes_only_json_lines(tmp_path):
    """Two data-parallel ranks (two listeners): the second listener's bind must not put uvicorn's own
    text config back."""
    port, closed = free_port(), free_port()
    args = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm-url", f"http://127.0.0.1:{closed}",
            "--data-parallel-size", "2", "--log-level", "info", "--log-format", "json"]
    with kvroute(args, tmp_path) as (proc, out, err):
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=30, log=err)
        r = httpx.post(f"http://127.0.0.1:{port + 1}/v1/completions", json={"model": "m", "prompt": "hi"},
                       trust_env=False, timeout=30)
        assert r.status_code == 503
        wait_for(err, lambda rs: any(x["logger"] == "kvroute.sidecar" and "unreachable" in x["msg"] for x in rs),
                 "the sidecar's own warning")
    logged = json_lines(err)
    msgs = [r["msg"] for r in logged]
    assert {f"Uvicorn running on http://127.0.0.1:{p} (Press CTRL+C to quit)" for p in (port, port + 1)} <= set(msgs)
    assert "Application startup complete." in msgs and any(m.startswith("Finished server process") for m in msgs)
    assert any(r["logger"] == "kvroute.sidecar" and r["level"] == "WARNING" and r["msg"].startswith("SSRF protection")
               for r in logged)
    assert out.read_text() == ""
