"""``kvroute serve``: read settings (YAML < env KVROUTE_* < flags) and run the gateway under uvicorn."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from kvcommon.settings import load_settings
from router.config import RouterSettings


def build_app(settings: RouterSettings, bus_forwarder: tuple[str, str] | None = None,
              bus_siblings: str | None = None):
    """The ASGI app for ``settings`` (the parts start in the app's lifespan); a worker's booking bus
    goes through ``bus_forwarder`` or straight to its siblings in ``bus_siblings`` (``main``)."""
    from router.api import create_app
    from router.service import Services

    # a tokenize thread's Python work (chunk hashes, block keys of a 32k-token prompt) holds the GIL
    # for up to the switch interval at a time: Python's 5 ms showed in small requests' p99 beside big
    # prompts; 0.5 ms measured 6.2-6.4 ms against 12-15 ms (bench/gil_hold.py, docs/router.md)
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000.0)
    # the prefix token cache tokenizes a prompt's new chunks in one batch call: on the library's
    # worker threads they would spin on the other core for the same work (indexer/prefix_tokens.py)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return create_app(Services(settings, bus_forwarder=bus_forwarder, bus_siblings=bus_siblings))


_SETTINGS_ENV = "KVROUTE_SERVE_WORKER_SETTINGS"
# "<pub endpoint> <sub endpoint>" of the parent's forwarder, or "siblings <directory>"
_BUS_ENV = "KVROUTE_SERVE_WORKER_BOOKING_BUS"


def worker_app():
    """App factory for ``workers > 1``: each worker process rebuilds the settings the parent parsed
    and joins the booking bus the parent set up, if any."""
    import json

    from kvcommon.settings import build_settings

    bus = os.environ.get(_BUS_ENV, "").split()
    siblings = len(bus) == 2 and bus[0] == "siblings"
    settings = build_settings(RouterSettings, json.loads(os.environ[_SETTINGS_ENV]))
    if settings.log_format == "json":  # uvicorn configured the loggers here; warnings and crashes as JSON too
        from kvcommon.logs import json_hooks

        json_hooks()
    app = build_app(settings, bus_forwarder=(bus[0], bus[1]) if len(bus) == 2 and not siblings else None,
                    bus_siblings=bus[1] if siblings else None)
    app.state.freeze_gc = True  # router.api.freeze_startup_heap, once the worker has started
    return app


def _reloader(argv: list[str] | None):
    """Re-parse the same command line (so the YAML is read again); raises instead of printing,
    since a bad file's values may be secrets."""
    import argparse

    from kvcommon.settings import add_settings_arguments, settings_from_args

    parser = argparse.ArgumentParser(prog="kvroute serve")
    add_settings_arguments(parser, RouterSettings)
    args = parser.parse_args(argv)
    return lambda: settings_from_args(RouterSettings, args)


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(RouterSettings, argv, prog="kvroute serve",
                             description="Run the KV-cache-aware router in front of a fleet of vLLM pods.")
    if not settings.pods and settings.discovery == "static":
        print("kvroute serve: no pods configured (give --pods JSON or a --config YAML with a pods: list)",
              file=sys.stderr)
        return 2
    from router.discovery import discovery_problem

    problem = discovery_problem(settings)
    if problem:
        print(f"kvroute serve: {problem}", file=sys.stderr)
        return 2
    from kvcommon.logs import configure_logging

    # the same mapping goes to uvicorn, which applies it again here and in each worker process (the
    # root logger included, so the workers' own lines have the format and level too)
    logging_config = configure_logging(settings.log_level, settings.log_format)
    import uvicorn

    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401
        http = "httptools"
    except ImportError:
        http = "h11"
    from kvcommon.listener import guarded_protocol

    if http == "httptools":  # header, body and idle bounds on every connection (kvcommon/listener.py)
        body_s = settings.body_timeout_s + 2.0 if settings.body_timeout_s else None  # the app's 408 comes first
        http = guarded_protocol(settings.header_timeout_s, body_s, settings.max_header_bytes)
    # ws="none": nothing here speaks WebSocket, and the WebSocket library logs handshake headers
    # (Authorization included) at debug level. proxy_headers: uvicorn's X-Forwarded-For/-Proto
    # middleware sets the client address that the access log reads (and X-Forwarded-For: with the
    # middleware a trusted peer's header names the client), so it runs only with the
    # access log (a layer less per request otherwise: 8,628 instructions of 727,618)
    common: dict[str, Any] = dict(
        host=settings.host, port=settings.port, loop=loop, http=http, ws="none",
        log_level=settings.log_level.lower(), access_log=settings.access_log, proxy_headers=settings.access_log,
        lifespan="on",
        timeout_keep_alive=settings.keep_alive_s, timeout_graceful_shutdown=settings.shutdown_timeout_s,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile, log_config=logging_config)
    if settings.workers > 1:
        os.environ[_SETTINGS_ENV] = settings.model_dump_json()
        forwarder, siblings = None, None
        from router.bookbus import bus_replicas

        if settings.booking_bus and bus_replicas(settings):  # through a forwarder here, bound for the replicas
            from router.bookbus import BusKey, Forwarder

            forwarder = Forwarder(settings.booking_bus_hwm, extra_binds=[settings.booking_bus_bind]
                                  if settings.booking_bus_bind else [], key=BusKey.of(settings)).start()
            os.environ[_BUS_ENV] = f"{forwarder.pub_endpoint} {forwarder.sub_endpoint}"
        elif settings.booking_bus:  # straight to each other, each worker's socket in this directory
            from router.bookbus import siblings_directory

            siblings = siblings_directory()
            os.environ[_BUS_ENV] = f"siblings {siblings}"
        try:
            uvicorn.run("router.serve:worker_app", factory=True, workers=settings.workers, **common)
        finally:
            if forwarder is not None:
                forwarder.stop()
            if siblings is not None:
                shutil.rmtree(siblings, ignore_errors=True)
    else:
        app = build_app(settings)
        app.state.reload_settings = _reloader(argv)  # SIGHUP re-reads API keys and rate limits
        app.state.freeze_gc = True  # router.api.freeze_startup_heap, once the router has started
        uvicorn.run(app, **common)
    return 0
