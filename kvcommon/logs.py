"""Logging for every kvroute service (router, sidecar, simulated pod): text as it always was, or JSON
lines for a log pipeline (Loki, Elasticsearch) that wants one object per line.

``log_format: json`` writes each record as one line::

    {"ts":"2026-05-09T07:35:25.123Z","level":"WARNING","logger":"kvroute.pods","pid":4242,"msg":"pod p0 unhealthy"}

``ts`` is the record's time in UTC (ISO 8601, milliseconds), ``level`` Python's level name, ``logger``
the logger's name, ``pid`` the process (one of ``kvroute serve --workers N``'s), ``msg`` the formatted
message, and ``exc`` (the formatted traceback) and ``stack`` only when the record has them. The line
stays one valid JSON line whatever the message holds: newlines and quotes are escaped, lone surrogates
(undecodable bytes read with ``surrogateescape``) are written as ``\\udcXX`` text, and U+2028, U+2029
and U+0085 are escaped too (readers that split on them would cut the line).

``logging_config`` is a ``logging.config.dictConfig`` mapping for the root logger and uvicorn's
loggers (uvicorn's own config, with ``RedactQuery`` on the access log, and in JSON every formatter
replaced by ``JsonFormatter``). The services give it to uvicorn as ``log_config``, so the worker
processes of ``kvroute serve --workers N``, which apply it again at their start, log the same way.
Setup happens once at start; nothing here runs per request beyond formatting the records logged.
"""

from __future__ import annotations

import copy
import logging
import logging.config
import sys
import threading
import time
from types import TracebackType
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]
LOG_LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# valid JSON, but line breaks to readers that split on every Unicode line boundary (str.splitlines)
_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def _clean(value: Any) -> Any:
    """A string that UTF-8 can encode: lone surrogates become their ``\\udcXX`` escape as text."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def json_line(fields: dict[str, Any]) -> str:
    """``fields`` (strings and numbers) as one line of JSON, without the newline."""
    try:
        raw = orjson.dumps(fields)
    except TypeError:  # orjson.JSONEncodeError: a str with lone surrogates
        raw = orjson.dumps({k: _clean(v) for k, v in fields.items()})
    for seq, escaped in _BREAKS:
        if seq in raw:
            raw = raw.replace(seq, escaped)
    return raw.decode("utf-8")


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: ``ts``, ``level``, ``logger``, ``pid``, ``msg``, and ``exc`` / ``stack``
    when it has them. ``use_colors`` is taken and ignored: uvicorn sets it on its formatters' configs."""

    def __init__(self, use_colors: bool | None = None) -> None:
        super().__init__()

    def format(self, record: logging.LogRecord) -> str:
        try:
            msg = record.getMessage()
        except Exception as exc:  # a bad log call: say so on the line rather than print a "Logging error" trace
            msg = f"{record.msg} (log arguments did not fit the message: {type(exc).__name__})"
        fields: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "pid": record.process, "msg": msg}
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            fields["exc"] = record.exc_text
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        return json_line(fields)


def check_level(value: Any) -> str:
    """A log level setting, lower-cased: one of ``LOG_LEVELS`` (upper case accepted); a ValueError names them."""
    if isinstance(value, str) and value.lower() in LOG_LEVELS:
        return value.lower()
    raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")


def logging_config(level: str, log_format: LogFormat = "text") -> dict[str, Any]:
    """A ``dictConfig`` mapping: the root logger at ``level`` (text: ``TEXT_FORMAT`` on stderr, as
    ``logging.basicConfig`` did) and uvicorn's loggers as uvicorn configures them, its access log
    without query strings (``kvcommon.listener.RedactQuery``); in JSON, every handler writes
    ``JsonFormatter`` lines. uvicorn sets its own loggers' levels from its ``log_level``."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_query"] = {"()": "kvcommon.listener.RedactQuery"}
    config["handlers"]["access"]["filters"] = ["redact_query"]
    config["formatters"]["kvroute"] = {"format": TEXT_FORMAT}
    config["handlers"]["kvroute"] = {"class": "logging.StreamHandler", "formatter": "kvroute",
                                     "stream": "ext://sys.stderr"}
    config["root"] = {"level": check_level(level).upper(), "handlers": ["kvroute"]}
    if log_format == "json":
        for name in config["formatters"]:
            config["formatters"][name] = {"()": "kvcommon.logs.JsonFormatter"}
    elif log_format != "text":
        raise ValueError(f"unknown log format {log_format!r}")
    return config


def configure_logging(level: str, log_format: LogFormat = "text") -> dict[str, Any]:
    """Configure this process's logging (at start) and return the mapping, for uvicorn's ``log_config``.
    In JSON, Python's warnings and uncaught exceptions (main thread or other threads) are logged too,
    so nothing reaches stderr as bare text."""
    config = logging_config(level, log_format)
    logging.config.dictConfig(config)
    if log_format == "json":
        json_hooks()
    return config


def json_hooks() -> None:
    """Route ``warnings`` and uncaught exceptions through logging (a JSON line, not a bare traceback)."""
    logging.captureWarnings(True)
    log = logging.getLogger("kvroute")

    def excepthook(typ: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(typ, KeyboardInterrupt):
            sys.__excepthook__(typ, value, tb)
            return
        log.critical("uncaught exception", exc_info=(typ, value, tb))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        log.error("uncaught exception in thread %s", name, exc_info=args.exc_value or True)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
