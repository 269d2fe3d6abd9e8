"""Which prefill targets the sidecar may call: the SSRF allowlist and the resolution of target names.

Three sources feed one snapshot of allowed (network, port) entries:

* static entries (IPs, CIDRs, each optionally with a port), fixed at start;
* names (from the static list or ``--prefill-allow-dns``), re-resolved every ``dns_refresh_s``;
* a URL answering a JSON list of ``host:port`` strings (e.g. the router's published prefill set),
  re-fetched every ``allowlist_refresh_s``; names in it are resolved too. With ``url_key`` the fetch
  sends it as ``Authorization: Bearer`` (a router with API keys answers that set to admin keys only);
  the key never reaches a log line or an error.

A failed refresh keeps the last good addresses of that source and is counted; the check itself
never does I/O except resolving the target's own name. A target is allowed only if every address
its name resolves to is allowed, and the sidecar then connects to that checked address, so a
name cannot resolve one way for the check and another for the connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
import orjson

from sidecar.targets import AllowEntry, IPAddress, TargetError, canonical_ip, parse_allow_entry, parse_ip

log = logging.getLogger("kvroute.sidecar.allowlist")

Resolver = Callable[[str], Awaitable[list[IPAddress]]]


async def resolve_name(name: str) -> list[IPAddress]:
    """Every address ``name`` resolves to (canonical, deduplicated, in resolver order)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    seen: dict[IPAddress, None] = {}
    for _family, _type, _proto, _canon, sockaddr in infos:
        ip = parse_ip(str(sockaddr[0]))
        if ip is not None:
            seen.setdefault(canonical_ip(ip), None)
    return list(seen)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable view of the allowed entries at one moment."""

    entries: tuple[AllowEntry, ...] = ()

    def allows(self, address: IPAddress, port: int) -> bool:
        return any(entry.matches(address, port) for entry in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def parse_published_list(payload: bytes) -> list[str]:
    """The router's published prefill set: a JSON list of ``host:port`` strings (or ``{"pods": [...]}``)."""
    data = orjson.loads(payload)
    if isinstance(data, dict):
        data = data.get("pods")
    if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
        raise ValueError('expected a JSON list of "host:port" strings')
    return data


def split_entries(texts: Iterable[str]) -> tuple[list[AllowEntry], list[AllowEntry], list[str]]:
    """(address entries, name entries, errors) for a list of allowlist strings."""
    addresses: list[AllowEntry] = []
    names: list[AllowEntry] = []
    errors: list[str] = []
    for text in texts:
        try:
            entry = parse_allow_entry(text)
        except TargetError as exc:
            errors.append(f"{text!r}: {exc}")
            continue
        (names if entry.name is not None else addresses).append(entry)
    return addresses, names, errors


@dataclass
class _SourceState:
    """What one refreshing source contributes, kept across failed refreshes."""

    entries: list[AllowEntry] = field(default_factory=list)
    last_ok: float | None = None
    errors: int = 0


class Allowlist:
    """Holds the current snapshot and refreshes its name and URL sources in the background."""

    def __init__(self, static: list[str], dns_names: list[str], url: str | None, *,
                 dns_refresh_s: float = 30.0, url_refresh_s: float = 10.0,
                 resolver: Resolver = resolve_name,
                 on_refresh_error: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, url_key: str | None = None) -> None:
        addresses, names, errors = split_entries([*static, *dns_names])
        if errors:
            raise ValueError("bad allowlist entries: " + "; ".join(errors))
        self._static = addresses
        self._names = names
        self._url = url
        self._url_headers = {"Authorization": f"Bearer {url_key}"} if url_key else {}
        self._dns_refresh_s = dns_refresh_s
        self._url_refresh_s = url_refresh_s
        self._resolve = resolver
        self._on_error = on_refresh_error or (lambda source: None)
        self._clock = clock
        self._dns = _SourceState()
        self._published = _SourceState()
        self._dns_by_name: dict[AllowEntry, list[AllowEntry]] = {}
        self._snapshot = Snapshot(tuple(addresses))
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def configured(self) -> bool:
        """True when any source could ever allow something."""
        return bool(self._static or self._names or self._url)

    def _rebuild(self) -> None:
        self._snapshot = Snapshot(tuple([*self._static, *self._dns.entries, *self._published.entries]))

    async def _resolve_entries(self, names: list[AllowEntry]) -> dict[AllowEntry, list[AllowEntry] | None]:
        """Each name entry -> the address entries it resolves to (same port), or None if it failed."""
        results = await asyncio.gather(*(self._resolve(n.name or "") for n in names), return_exceptions=True)
        out: dict[AllowEntry, list[AllowEntry] | None] = {}
        for entry, result in zip(names, results):
            if isinstance(result, BaseException):
                out[entry] = None
            else:
                out[entry] = [AllowEntry(parse_allow_entry(str(ip)).network, None, entry.port) for ip in result]
        return out

    async def refresh_dns(self) -> None:
        """Re-resolve the configured names; a name that fails this time keeps its previous addresses."""
        if not self._names:
            return
        results = await self._resolve_entries(self._names)
        failed = [entry.name for entry, got in results.items() if got is None]
        for entry, got in results.items():
            if got is not None:
                self._dns_by_name[entry] = got
        if failed:
            self._dns.errors += 1
            self._on_error("dns")
            log.warning("could not resolve allowlisted names: %s", ", ".join(str(n) for n in failed))
        else:
            self._dns.last_ok = self._clock()
        self._dns.entries = [e for got in self._dns_by_name.values() for e in got]
        self._rebuild()

    async def refresh_url(self) -> None:
        """Fetch the published prefill set; on any failure keep the last good one."""
        if not self._url or self._session is None:
            return
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, min(self._url_refresh_s, 10.0)))
            async with self._session.get(self._url, timeout=timeout, allow_redirects=False,
                                         headers=self._url_headers) as resp:
                body = await resp.read()
                if resp.status in (401, 403):
                    raise ValueError(self._refused(resp.status))
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
            addresses, names, errors = split_entries(parse_published_list(body))
            if errors:
                log.warning("ignoring bad entries from %s: %s", self._url, "; ".join(errors))
            results = await self._resolve_entries(names)
            resolved = [e for got in results.values() if got for e in got]
            failed = [str(entry.name) for entry, got in results.items() if got is None]
            if failed:
                log.warning("could not resolve published prefill names: %s", ", ".join(failed))
        except (TimeoutError, aiohttp.ClientError, ValueError, orjson.JSONDecodeError) as exc:
            self._published.errors += 1
            self._on_error("url")
            log.warning("could not fetch the prefill allowlist from %s: %s", self._url, exc)
            return
        self._published.entries = addresses + resolved
        self._published.last_ok = self._clock()
        self._rebuild()

    def _refused(self, status: int) -> str:
        """Why the URL refused the fetch, naming the setting to fix (never the key)."""
        if not self._url_headers:
            return (f"status {status}: it needs a key and none is set (--prefill-allowlist-key, "
                    "env KVROUTE_SIDECAR_PREFILL_ALLOWLIST_KEY: an admin API key of the router)")
        if status == 401:
            return f"status {status}: it refused the key of --prefill-allowlist-key (not one of its API keys)"
        return f"status {status}: it refused the key of --prefill-allowlist-key (not an admin key)"

    async def _every(self, seconds: float, refresh: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await refresh()
            except Exception:  # a refresh must never end the loop
                log.exception("allowlist refresh failed")

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Load every source once, then keep refreshing in the background."""
        self._session = session
        await asyncio.gather(self.refresh_dns(), self.refresh_url())
        if self._names:
            self._tasks.append(asyncio.create_task(self._every(self._dns_refresh_s, self.refresh_dns)))
        if self._url:
            self._tasks.append(asyncio.create_task(self._every(self._url_refresh_s, self.refresh_url)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()


class TargetResolver:
    """Resolves prefill target names with a short cache, so a burst of requests costs one lookup."""

    def __init__(self, resolver: Resolver = resolve_name, ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = 1024) -> None:
        self._resolve = resolver
        self._ttl = ttl_s
        self._clock = clock
        self._max = max_entries
        self._cache: dict[str, tuple[float, list[IPAddress]]] = {}

    async def resolve(self, name: str) -> list[IPAddress]:
        now = self._clock()
        hit = self._cache.get(name)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        addresses = await self._resolve(name)
        if self._ttl > 0:
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[name] = (now, addresses)
        return addresses
