"""NIXL prefill/decode as the simulated pods do it (the ``kv_transfer_params`` of vLLM 0.32, measured).

Prefill side (``do_remote_decode: true``): the request runs as usual (one token), but its blocks
stay referenced under a *lease* until the decoder reads them or ``nixl_lease_timeout_s`` passes,
whether its one token ended the request by length or by a stop (EOS, a stop token or string: vLLM
0.32 leases on ``FINISHED_STOPPED`` too); the response carries ``kv_transfer_params`` naming this
pod's engine, request and "side channel" (its own HTTP host and port), ``remote_block_ids`` as one
list per KV-cache group, and ``remote_prefill_cached_tokens`` (its own prefix-cache hits).

Decode side (``do_remote_prefill: true``): the pod asks the named prefill pod over HTTP
(``POST /sim/nixl/read``) for the leased blocks it does not hold itself, waits the simulated link
time (``nixl_latency_s + bytes / nixl_bandwidth_bytes_per_s``), then tells the prefill pod it is
done (``POST /sim/nixl/release``), which ends the lease. The received blocks are then cached
(BlockStored on the decoder) and only the last prompt token is computed locally; the metrics say
what vLLM's do: every prompt token past the local hit is ``external_kv_transfer`` (the recomputed
last one included), and each read observes ``vllm:nixl_bytes_transferred`` (whole blocks, the
partial last one included) and ``vllm:nixl_xfer_time_seconds``. If the parameters are incomplete,
the host is not allowed, or the read fails, the decoder computes the whole prompt itself, as vLLM
falls back to local prefill (a failed read counts in ``vllm:nixl_num_failed_transfers``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from simulator.metrics import PodMetrics
from simulator.tasks import cancel_and_wait

log = logging.getLogger("kvroute.sim.nixl")

REQUIRED_DECODE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    expires_at: float
    release: Callable[[], None] = field(repr=False, default=lambda: None)


class LeaseTable:
    """Blocks held for remote decoders, keyed by the prefill pod's request id."""

    def __init__(self, metrics: PodMetrics, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self._task: asyncio.Task | None = None

    def add(self, request_id: str, block_ids: list[int], num_tokens: int, release: Callable[[], None]) -> Lease:
        lease = Lease(request_id, list(block_ids), num_tokens, self.clock() + self.timeout_s, release)
        old = self.leases.pop(request_id, None)
        if old is not None:
            old.release()
        self.leases[request_id] = lease
        self._gauge()
        return lease

    def get(self, request_id: str) -> Lease | None:
        lease = self.leases.get(request_id)
        if lease is not None and lease.expires_at <= self.clock():
            self._end(request_id, timed_out=True)
            return None
        return lease

    def end(self, request_id: str) -> bool:
        """The decoder has read the blocks: free them. False if there was no such lease."""
        if request_id not in self.leases:
            return False
        self._end(request_id, timed_out=False)
        return True

    def expire(self) -> int:
        now = self.clock()
        gone = [rid for rid, lease in self.leases.items() if lease.expires_at <= now]
        for rid in gone:
            self._end(rid, timed_out=True)
        return len(gone)

    def _end(self, request_id: str, timed_out: bool) -> None:
        lease = self.leases.pop(request_id)
        lease.release()
        if timed_out:
            self.metrics.lease_timeouts.inc()
            log.info("NIXL lease %s timed out", request_id)
        self._gauge()

    def _gauge(self) -> None:
        self.metrics.leases.set(len(self.leases))
        self.metrics.leased_blocks.set(sum(len(lease.block_ids) for lease in self.leases.values()))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        period = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            self.expire()

    async def stop(self) -> None:
        await cancel_and_wait(self._task)


def producer_params(*, block_ids: list[int], engine_id: str, request_id: str, host: str, port: int,
                    num_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill pod returns (the field set vLLM 0.32 answered; one KV-cache
    group; a prefill's params carry no expiry time, only a decoder's pinned blocks do)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached_tokens,
    }


def flat_block_ids(value: Any) -> list[int] | None:
    """``remote_block_ids`` as one list: a list per KV-cache group (0.33) or a flat list (older)."""
    if not isinstance(value, list):
        return None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    if value and all(isinstance(g, list) for g in value):
        first = value[0]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in first):
            return list(first)
    return None


def decode_params_problem(params: dict[str, Any], allowed_hosts: list[str]) -> str | None:
    """Why a decode leg cannot read remotely (None = it can)."""
    missing = [k for k in REQUIRED_DECODE_FIELDS if params.get(k) is None]
    if missing:
        return f"missing {missing}"
    if not isinstance(params["remote_host"], str) or not isinstance(params["remote_port"], int):
        return "remote_host must be a string and remote_port an integer"
    if not 0 < params["remote_port"] < 65536:
        return "remote_port out of range"
    if "*" not in allowed_hosts and params["remote_host"] not in allowed_hosts:
        return f"remote_host {params['remote_host']!r} is not in nixl_allowed_hosts"
    if flat_block_ids(params["remote_block_ids"]) is None:
        return "remote_block_ids must be a list of ints or a list of lists of ints"
    return None


@dataclass
class NixlRead:
    """One read by a decoder: how many prompt tokens now have KV here (0: it failed, compute locally),
    the bytes moved and how long the move took."""

    tokens: int
    bytes: int = 0
    seconds: float = 0.0


async def remote_read(client: httpx.AsyncClient, params: dict[str, Any], *, skip_blocks: int,
                      block_size: int, kv_bytes_per_token: int, bandwidth: float, latency: float,
                      slowdown: float = 1.0) -> NixlRead:
    """Read the prefill pod's leased blocks (all but the first ``skip_blocks``, already local)."""
    base = f"http://{params['remote_host']}:{params['remote_port']}"
    rid = params["remote_request_id"]
    body = {"remote_request_id": rid, "remote_engine_id": params["remote_engine_id"]}
    try:
        r = await client.post(f"{base}/sim/nixl/read", json=body)
        if r.status_code != 200:
            log.info("NIXL read of %s refused: %s %s", rid, r.status_code, r.text[:200])
            return NixlRead(0)
        info = r.json()
        num_blocks = int(info["num_blocks"])
        num_tokens = int(info["num_tokens"])
        moved = max(0, num_blocks - skip_blocks) * block_size * kv_bytes_per_token
        seconds = (latency + moved / bandwidth) * slowdown
        await asyncio.sleep(seconds)
        await client.post(f"{base}/sim/nixl/release", json=body)
        return NixlRead(num_tokens, moved, seconds)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.info("NIXL read of %s failed: %s", rid, exc)
        return NixlRead(0)
