"""The prediction log: one JSON line per request whose first token the router timed, with what it
predicted and why, so a fleet's prediction error can be taken apart offline (by pod, by uncached
work, by batch size) instead of read as one MAPE.

Off by default (``prediction_log_path``). Lines are written from the event loop as the first tokens
arrive (a few hundred bytes each, one write(2) per line); once ``prediction_log_max_bytes`` have
been written the log stops, says so once, and the router goes on. Each worker process of
``--workers N`` writes ``<path>.<pid>``. A line:

``{"t": unix time, "pod", "prefill_pod", "mode", "work_tokens" (the prefill work ahead of the first
token: the queue the ledger saw plus this request's uncached tokens), "cached_tokens", "new_blocks",
"running" (requests running on the prefilling pod when routed), "predicted_s" (after the error
model), "model_s" (the calibrated model before it), "low_s", "high_s" (the interval),
"observed_s"}``
"""

from __future__ import annotations

import logging
import os
import time
from typing import IO, Any

import orjson

log = logging.getLogger("kvroute.predlog")


class PredictionLog:
    def __init__(self, path: str, max_bytes: int):
        self.path = path
        self.max_bytes = max_bytes
        # unbuffered: one write(2) per line (a few microseconds), so a reader sees each line at once
        self._file: IO[bytes] | None = open(path, "ab", buffering=0)  # noqa: SIM115 - open for the router's life
        # appended to: what earlier runs wrote counts, so restarts cannot grow the file past max_bytes
        self.written = os.fstat(self._file.fileno()).st_size

    def write(self, booking: Any, observed_s: float) -> None:
        f = self._file
        if f is None:
            return
        line = orjson.dumps({
            "t": round(time.time(), 3), "pod": booking.pod_id, "prefill_pod": booking.prefill_pod,
            "mode": booking.mode, "work_tokens": round(booking.work_tokens), "cached_tokens": booking.cached_tokens,
            "new_blocks": booking.new_blocks, "running": booking.running,
            "predicted_s": round(booking.predicted_ttft_s, 5), "model_s": round(booking.model_ttft_s, 5),
            "low_s": round(booking.ttft_low_s, 5),
            "high_s": round(booking.ttft_high_s, 5) if booking.ttft_high_s != float("inf") else None,
            "observed_s": round(observed_s, 5)}) + b"\n"
        if self.written + len(line) > self.max_bytes:
            log.warning("prediction log %s reached prediction_log_max_bytes (%d): no more lines", self.path,
                        self.max_bytes)
            self.close()
            return
        f.write(line)
        self.written += len(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
