"""``kvroute sim``: run one or more simulated vLLM pods in this process until interrupted."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from kvcommon.logs import configure_logging
from kvcommon.settings import load_settings
from simulator.events import KVEventsConfigError
from simulator.settings import SimSettings

DESCRIPTION = (
    "Run simulated vLLM pods: vLLM's OpenAI HTTP surface, ZeroMQ KV-cache events with replay, NIXL "
    "kv_transfer_params in both roles, vLLM metric names, a prefix cache with LRU eviction and a timing "
    "model; no GPU. With --count N, pod i listens on --port + i and (with KV events on) publishes on the "
    "events port + 2i and replays on the replay port + 2i.")


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(SimSettings, argv, prog="kvroute sim", description=DESCRIPTION)
    # the pods' uvicorn servers apply uvicorn's own config to its loggers (simulator/server.py)
    configure_logging(settings.log_level, settings.log_format)
    try:
        from simulator.server import SimFleet

        fleet = SimFleet(settings)
    except (KVEventsConfigError, OSError) as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    for pod in fleet.pods:
        events = ""
        if pod.events_config is not None and pod.events_config.enabled:
            events = (f" events={pod.events_config.endpoint} replay={pod.events_config.replay_endpoint}"
                      f" topic={pod.events_config.topic!r}")
        print(f"sim pod {pod.name}: http://{pod.host}:{pod.port} model={pod.model} engine_id={pod.engine_id}"
              f" timing={settings.timing}{events}", flush=True)
    run: Callable[[Coroutine[Any, Any, Any]], Any]
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        run = asyncio.run
    try:
        run(fleet.serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
