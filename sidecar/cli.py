"""``kvroute sidecar``: run the prefill/decode sidecar beside one decode vLLM."""

from __future__ import annotations

import logging

import uvicorn

from kvcommon.listener import guarded_protocol
from kvcommon.logs import configure_logging
from kvcommon.settings import load_settings
from sidecar.config import SidecarSettings
from sidecar.proxy import SidecarApp

DESCRIPTION = (
    "Prefill/decode sidecar for NIXL disaggregation, a drop-in for llm-d's pd-sidecar. A request with "
    "x-prefiller-host-port: HOST:PORT is prefilled there (max_tokens=1, do_remote_decode) and decoded "
    "by the local vLLM with the returned kv_transfer_params; without the header it goes straight to the "
    "local vLLM. Prefill targets must be allowlisted unless --no-ssrf-protection."
)


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(SidecarSettings, argv, prog="kvroute sidecar", description=DESCRIPTION)
    logging_config = configure_logging(settings.log_level, settings.log_format)
    try:
        app = SidecarApp(settings)
    except ValueError as exc:
        logging.getLogger("kvroute.sidecar").error("%s", exc)
        return 2
    # header, body and idle bounds on every connection (kvcommon/listener.py); ws="none": nothing here
    # speaks WebSocket, and the WebSocket library logs handshake headers (Authorization) at debug level
    http = guarded_protocol(settings.header_timeout_s, settings.body_timeout_s + 2.0, settings.max_header_bytes)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                            log_level=settings.log_level, access_log=False, server_header=False,
                            ssl_certfile=settings.ssl_certfile, ssl_keyfile=settings.ssl_keyfile,
                            # uvicorn hints int but takes any number of seconds (a call_later delay)
                            timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=30, ws="none",
                            http=http, log_config=logging_config)
    server = uvicorn.Server(config)
    if settings.data_parallel_size == 1:
        server.run()
    else:  # one listener per data-parallel rank: --port + r (sidecar/dataparallel.py)
        try:
            # log_config=None: a Config applies its logging config, and uvicorn's default would undo ours
            sockets = [uvicorn.Config(app, host=settings.host, port=port, log_config=None).bind_socket()
                       for port in app.dp.ports]
        except SystemExit:  # uvicorn exits when a port is taken; it has logged which
            return 1
        server.run(sockets=sockets)
    return 0 if server.started else 1
