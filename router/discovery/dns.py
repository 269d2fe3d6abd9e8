"""DNS discovery: every A/AAAA record of a name (a headless Service) is a pod, re-resolved.

DNS carries no labels, so role, model and ports come from settings and are the same for every pod;
the pod id is its address. A failed lookup (timeout, SERVFAIL, unreachable server) keeps the fleet
as it was, since a flaky resolver must not empty the router; an authoritative "no such name" or an
empty answer is a fleet of none. The resolver is a plain async function, so it can be the system's
(``getaddrinfo``) or, with ``discovery_dns_server``, a small UDP client that asks one server
directly (for a resolver other than the system's, and for tests).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
import struct
from collections.abc import Awaitable, Callable

from router.config import EventEndpoint, PodConfig, RouterSettings
from router.discovery.fleet import DiscoveredPod, FleetSync

log = logging.getLogger("kvroute.discovery")

Resolver = Callable[[str], Awaitable[list[str]]]
TYPE_A, TYPE_AAAA = 1, 28


class ResolveError(Exception):
    """The lookup failed (as opposed to answering that there are no addresses)."""


async def system_resolve(name: str) -> list[str]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise ResolveError(str(exc)) from exc
    return sorted({str(info[4][0]) for info in infos})


def encode_query(name: str, qtype: int, qid: int) -> bytes:
    labels = b"".join(bytes([len(p)]) + p for p in (s.encode("idna") for s in name.rstrip(".").split(".")) if p)
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\x00" + struct.pack("!HH", qtype, 1)


def _skip_name(msg: bytes, i: int) -> int:
    while True:
        if i >= len(msg):
            raise ResolveError("truncated name")
        n = msg[i]
        if n == 0:
            return i + 1
        if n & 0xC0 == 0xC0:
            return i + 2
        i += 1 + n


def decode_answer(msg: bytes, qid: int) -> list[str]:
    """Addresses in a DNS response; [] for NXDOMAIN or no records; ResolveError for anything else."""
    if len(msg) < 12:
        raise ResolveError("short response")
    rid, flags, qd, an, _, _ = struct.unpack("!HHHHHH", msg[:12])
    if rid != qid:
        raise ResolveError("response id mismatch")
    rcode = flags & 0xF
    if rcode == 3:
        return []
    if rcode != 0:
        raise ResolveError(f"rcode {rcode}")
    i = 12
    for _ in range(qd):
        i = _skip_name(msg, i) + 4
    out = []
    for _ in range(an):
        i = _skip_name(msg, i)
        if i + 10 > len(msg):
            raise ResolveError("truncated record")
        rtype, _, _, rdlen = struct.unpack("!HHIH", msg[i:i + 10])
        i += 10
        data = msg[i:i + rdlen]
        if len(data) != rdlen:
            raise ResolveError("truncated record data")
        i += rdlen
        if rtype == TYPE_A and rdlen == 4:
            out.append(str(ipaddress.IPv4Address(data)))
        elif rtype == TYPE_AAAA and rdlen == 16:
            out.append(str(ipaddress.IPv6Address(data)))
    return out


class _Once(asyncio.DatagramProtocol):
    def __init__(self, fut: asyncio.Future):
        self.fut = fut

    def datagram_received(self, data, addr):
        if not self.fut.done():
            self.fut.set_result(data)

    def error_received(self, exc):
        if not self.fut.done():
            self.fut.set_exception(ResolveError(str(exc)))


def udp_resolver(server: str, timeout_s: float = 2.0) -> Resolver:
    """A resolver asking ``host:port`` over UDP for A and AAAA records."""
    host, _, port = server.rpartition(":")
    addr = (host.strip("[]") or "127.0.0.1", int(port or 53))

    async def ask(name: str, qtype: int) -> list[str]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        qid = random.getrandbits(16)
        transport, _ = await loop.create_datagram_endpoint(lambda: _Once(fut), remote_addr=addr)
        try:
            transport.sendto(encode_query(name, qtype, qid))
            try:
                return decode_answer(await asyncio.wait_for(fut, timeout_s), qid)
            except TimeoutError:
                raise ResolveError(f"no answer from {server} within {timeout_s}s") from None
        finally:
            transport.close()

    async def resolve(name: str) -> list[str]:
        a, aaaa = await asyncio.gather(ask(name, TYPE_A), ask(name, TYPE_AAAA))
        return sorted(set(a) | set(aaaa))

    return resolve


def resolver_for(settings: RouterSettings) -> Resolver:
    return udp_resolver(settings.discovery_dns_server) if settings.discovery_dns_server else system_resolve


def pod_for_address(ip: str, settings: RouterSettings) -> DiscoveredPod:
    host = f"[{ip}]" if ":" in ip else ip
    http = settings.discovery_http_port
    engine = settings.discovery_engine_port or http
    endpoints = []
    if settings.discovery_kv_events_port:
        for r in range(max(1, settings.discovery_data_parallel_size)):
            replay = settings.discovery_kv_events_replay_port
            endpoints.append(EventEndpoint(endpoint=f"tcp://{host}:{settings.discovery_kv_events_port + r}",
                                           replay=f"tcp://{host}:{replay + r}" if replay else None))
    dp = max(1, settings.discovery_data_parallel_size)
    # external-lb: rank r's API server (and its /metrics) on the engine port + r, as the sidecar reaches it
    metrics = ([f"http://{host}:{engine + r}" for r in range(dp)]
               if settings.discovery_data_parallel_mode == "external-lb" and dp > 1 else [])
    return DiscoveredPod(PodConfig(id=ip, url=f"http://{host}:{http}", role=settings.discovery_role,
                                   model=settings.discovery_model, kv_events=endpoints,
                                   metrics_url=f"http://{host}:{engine}" if engine != http and not metrics else None,
                                   metrics_urls=metrics, data_parallel_size=dp))


class DNSDiscovery:
    """Re-resolves ``discovery_dns_name`` every ``discovery_interval_s`` and syncs the fleet."""

    def __init__(self, settings: RouterSettings, sync: FleetSync, resolve: Resolver):
        self.settings = settings
        self.sync = sync
        self.stats = sync.stats
        self.stats.mode = "dns"
        self.resolve = resolve
        self.name = settings.discovery_dns_name
        self.interval_s = settings.discovery_interval_s
        self._task: asyncio.Task | None = None

    async def refresh(self) -> bool:
        try:
            addresses = await self.resolve(self.name)
        except (ResolveError, OSError, ValueError) as exc:
            self.stats.error("resolve")
            log.warning("resolving %s failed (%s); keeping the fleet as it is", self.name, exc)
            return False
        self.stats.relists += 1
        self.sync.sync(pod_for_address(ip, self.settings) for ip in addresses)
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats.error("other")
                log.exception("DNS discovery round failed")

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="dns-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
