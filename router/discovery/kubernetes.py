"""Kubernetes discovery: list and watch the model pods through the API server's REST API.

The router's service account (``get/list/watch`` on pods in its namespace) is all it needs; the
token is re-read from its file on every request (projected tokens rotate) and the API server's
certificate is checked against the service account's CA. Each pod is described by the labels and
annotations of docs/deploy.md §2.6; readiness is the pod's ``Ready`` condition, and a pod with a
``deletionTimestamp`` is terminating, hence not ready, whatever its condition says.

Keeping the fleet right, not just usually right:

- *list, then watch from the list's resourceVersion*, so no change between the two is lost;
- a watch that ends (server timeout, dropped connection, API server restart) is opened again from
  the last resourceVersion seen (bookmarks keep it fresh while nothing changes);
- ``410 Gone`` (that version is too old for the server) -> a full re-list;
- a full re-list every ``discovery_relist_s`` regardless, replacing the fleet with what the list
  says, so a DELETE a watch never delivered cannot leave a dead pod routable for longer than that;
- any error is counted, logged and retried with capped backoff; the fleet keeps what it had.

A watch event changes the one pod it names (``FleetSync.update``), in the order received, so a burst
costs time in proportion to its events, not events x fleet size; the stream yields to the event loop
every ``YIELD_EVERY`` events, so a burst already buffered does not hold up routing while it is applied.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from kvcommon.settings import ConfigError
from router.config import EventEndpoint, PodConfig, RouterSettings
from router.discovery.fleet import DiscoveredPod, FleetSync

log = logging.getLogger("kvroute.discovery")

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
POOL, ROLE = "kvroute.io/pool", "kvroute.io/role"
MODEL, HTTP_PORT, ENGINE_PORT = "kvroute.io/model", "kvroute.io/http-port", "kvroute.io/engine-port"
EVENTS_PORT, REPLAY_PORT, DP_SIZE = ("kvroute.io/kv-events-port", "kvroute.io/kv-events-replay-port",
                                     "kvroute.io/data-parallel-size")
DP_START, DP_MODE = "kvroute.io/data-parallel-start-rank", "kvroute.io/data-parallel-mode"
DP_MODES = ("internal-lb", "external-lb")  # the sidecar's --data-parallel-mode
ROLES = ("prefill", "decode", "both")
YIELD_EVERY = 64  # watch events applied between two yields to the event loop


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410 or an ERROR event with code 410)."""


class APIError(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"API server answered {status}: {text[:300]}")
        self.status = status


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _port(value: Any) -> int | None:
    try:
        port = int(str(value))
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def is_ready(obj: Mapping[str, Any]) -> bool:
    """Running, not terminating, and its Ready condition True."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    for cond in status.get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def pod_from_object(obj: Mapping[str, Any]) -> DiscoveredPod | None:
    """The router's view of a Kubernetes pod object; None when it cannot be routed to (yet)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    name = meta.get("name")
    ip = status.get("podIP")
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    if not name or not ip or status.get("phase") in ("Succeeded", "Failed"):
        return None
    model = ann.get(MODEL)
    role = labels.get(ROLE, "both")
    http = _port(ann.get(HTTP_PORT, 8000))
    if not model or role not in ROLES or http is None:
        return None
    try:  # an address, nothing else: "10.0.0.1/x" made a URL whose host was 10.0.0.1 and port 80
        host = _host(str(ipaddress.ip_address(str(ip))))
    except ValueError:
        return None
    engine = _port(ann.get(ENGINE_PORT, http)) or http
    events, replay = _port(ann.get(EVENTS_PORT)), _port(ann.get(REPLAY_PORT))
    try:
        dp = max(1, min(64, int(str(ann.get(DP_SIZE, 1)))))
    except ValueError:
        dp = 1
    try:  # a later node of a multi-node deployment: vLLM offsets its ports by the global rank
        start = max(0, min(65535, int(str(ann.get(DP_START, 0)))))
    except ValueError:
        start = 0
    mode = str(ann.get(DP_MODE, "internal-lb"))
    if mode not in DP_MODES:
        return None
    # external-lb: rank r's API server (and its /metrics) on the engine port + r, as the sidecar reaches it
    metrics = [f"http://{host}:{engine + r}" for r in range(dp)] if mode == "external-lb" and dp > 1 else []
    if metrics and engine + dp - 1 > 65535:
        return None
    endpoints = []
    if events is not None:
        for r in range(start, start + dp):
            if events + r > 65535 or (replay is not None and replay + r > 65535):
                return None
            endpoints.append(EventEndpoint(endpoint=f"tcp://{host}:{events + r}",
                                           replay=f"tcp://{host}:{replay + r}" if replay is not None else None))
    try:  # what the pod checks refuse (a model name, ...): this pod is skipped, the list or watch goes on
        config = PodConfig(id=str(name), url=f"http://{host}:{http}", role=role, model=str(model),
                           kv_events=endpoints, data_parallel_size=dp, data_parallel_start_rank=start,
                           metrics_url=f"http://{host}:{engine}" if engine != http and not metrics else None,
                           metrics_urls=metrics)
    except ValueError:  # pydantic's ValidationError included
        return None
    return DiscoveredPod(config, is_ready(obj))


class KubernetesDiscovery:
    """Keeps a :class:`FleetSync` equal to the pods the label selector matches."""

    def __init__(self, sync: FleetSync, *, api_server: str, namespace: str, label_selector: str,
                 token_file: str | None = None, ca_file: str | None = None, relist_s: float = 60.0,
                 watch_timeout_s: int = 290, request_timeout_s: float = 10.0, backoff_max_s: float = 5.0,
                 first_sync_timeout_s: float = 10.0):
        self.sync = sync
        self.stats = sync.stats
        self.stats.mode = "kubernetes"
        self.api_server = api_server.rstrip("/")
        self.namespace = namespace
        self.label_selector = label_selector
        self.token_file = token_file
        self.ca_file = ca_file
        self.relist_s = relist_s
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.backoff_max_s = backoff_max_s
        self.first_sync_timeout_s = first_sync_timeout_s
        self.pods: dict[str, DiscoveredPod] = {}
        self.resource_version: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._first = asyncio.Event()

    @classmethod
    def from_settings(cls, settings: RouterSettings, sync: FleetSync) -> KubernetesDiscovery:
        api = settings.discovery_api_server
        if not api:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ConfigError("discovery 'kubernetes' needs discovery_api_server, or to run in a pod "
                                  "(KUBERNETES_SERVICE_HOST)")
            api = f"https://{_host(host)}:{port}"
        namespace = settings.discovery_namespace
        if not namespace:
            try:
                namespace = Path(NAMESPACE_FILE).read_text().strip()
            except OSError:
                raise ConfigError("discovery 'kubernetes' needs discovery_namespace (no service account "
                                  f"namespace at {NAMESPACE_FILE})") from None
        return cls(sync, api_server=api, namespace=namespace, label_selector=settings.discovery_label_selector,
                   token_file=settings.discovery_token_file, ca_file=settings.discovery_ca_file,
                   relist_s=settings.discovery_relist_s, watch_timeout_s=settings.discovery_watch_timeout_s)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Begin; returns after the first list (or after ``first_sync_timeout_s`` if it keeps failing)."""
        ssl_ctx: ssl.SSLContext | bool = False
        if self.api_server.startswith("https://"):
            ssl_ctx = ssl.create_default_context(cafile=self.ca_file if self.ca_file and os.path.exists(self.ca_file)
                                                 else None)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx, limit=4),
                                              read_bufsize=4 * 1024 * 1024)
        self._task = asyncio.create_task(self.run(), name="kubernetes-discovery")
        try:
            await asyncio.wait_for(self._first.wait(), self.first_sync_timeout_s)
        except TimeoutError:
            log.error("no pod list from %s within %.0fs; starting with an empty fleet and retrying",
                      self.api_server, self.first_sync_timeout_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self.relist()
                backoff = 0.1
                await self.watch_until(time.monotonic() + self.relist_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats.error(_kind(exc))
                log.warning("listing pods failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(self.backoff_max_s, backoff * 2)

    async def watch_until(self, deadline: float) -> None:
        """Watch from the last resourceVersion until ``deadline`` (then the caller re-lists) or 410."""
        backoff = 0.1
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            started = time.monotonic()
            try:
                await asyncio.wait_for(self.watch_once(), remaining)
                if time.monotonic() - started >= 1.0:  # a watch that ran its course
                    backoff = 0.1
                else:  # ended at once: a server (or proxy) that closes every watch must not be hammered
                    await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                    backoff = min(self.backoff_max_s, backoff * 2)
            except Gone:
                self.stats.gone += 1
                log.info("watch resourceVersion %s expired (410 Gone); re-listing", self.resource_version)
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return
                self.stats.error("timeout")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats.error(_kind(exc))
                log.warning("pod watch failed (%s); watching again in %.1fs", exc, backoff)
                await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(self.backoff_max_s, backoff * 2)
            self.stats.watch_restarts += 1

    # ---- REST ----------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError:
                token = ""
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    def _url(self, **params: str) -> str:
        query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items() if v not in (None, ""))
        return f"{self.api_server}/api/v1/namespaces/{quote(self.namespace, safe='')}/pods?{query}"

    async def relist(self) -> None:
        """List every matching pod (paged) and make the fleet exactly that."""
        assert self._session is not None
        pods: dict[str, DiscoveredPod] = {}
        cont, version = "", None
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        while True:
            url = self._url(labelSelector=self.label_selector, limit="500", **({"continue": cont} if cont else {}))
            async with self._session.get(url, headers=self._headers(), timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise APIError(resp.status, body.decode(errors="replace"))
            data = orjson.loads(body)
            meta = data.get("metadata") or {}
            version = meta.get("resourceVersion") or version
            for obj in data.get("items") or []:
                pod = pod_from_object(obj)
                if pod is None:
                    self.stats.skipped_pods += 1
                else:
                    pods[pod.id] = pod
            cont = meta.get("continue") or ""
            if not cont:
                break
        self.pods = pods
        self.resource_version = version
        self.stats.relists += 1
        self.sync.sync(self.pods)
        self._first.set()

    async def watch_once(self) -> None:
        """One watch request, applying events until the server ends the stream."""
        assert self._session is not None
        url = self._url(labelSelector=self.label_selector, watch="1", allowWatchBookmarks="true",
                        resourceVersion=self.resource_version or "", timeoutSeconds=str(self.watch_timeout_s))
        timeout = aiohttp.ClientTimeout(total=None, connect=self.request_timeout_s,
                                        sock_read=self.watch_timeout_s + 30)
        async with self._session.get(url, headers=self._headers(), timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status != 200:
                raise APIError(resp.status, (await resp.read()).decode(errors="replace"))
            applied = 0
            async for line in resp.content:
                line = line.strip()
                if line:
                    self.apply_event(orjson.loads(line))
                    applied += 1
                    if applied % YIELD_EVERY == 0:  # lines already buffered are read without a pause:
                        await asyncio.sleep(0)  # let requests be routed between slices of a burst

    def apply_event(self, event: Mapping[str, Any]) -> None:
        """One watch event: ADDED/MODIFIED/DELETED change the fleet; BOOKMARK moves the version."""
        kind = event.get("type")
        obj = event.get("object") or {}
        self.stats.watch_events += 1
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise APIError(int(obj.get("code") or 500), str(obj.get("message", "")))
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if kind == "BOOKMARK":
            return
        name = meta.get("name")
        if not name:
            return
        if kind == "DELETED":
            self.pods.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            pod = pod_from_object(obj)
            if pod is None:
                self.pods.pop(name, None)  # e.g. it finished (Succeeded/Failed) or lost what routing needs
                self.stats.skipped_pods += 1
            else:
                self.pods[name] = pod
        else:
            return
        # this pod only: a whole-fleet sync per event cost O(fleet) each (1.3 ms at 1,000 pods), so a
        # rollout's burst of events held the event loop for seconds; re-lists still sync the whole fleet
        self.sync.update(name, self.pods.get(name))


def _kind(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        return f"http_{exc.status}"
    if isinstance(exc, (aiohttp.ClientSSLError, ssl.SSLError)):
        return "tls"  # the API server's certificate does not check out against discovery_ca_file
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return "connection"
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, (ValueError, orjson.JSONDecodeError)):
        return "decode"
    return "other"
