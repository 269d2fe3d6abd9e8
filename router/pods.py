"""The fleet: pods from config, their health, and their load as their own /metrics report it.

One task per pod checks ``/health`` every ``health_interval_s`` and another scrapes ``/metrics``
every ``scrape_interval_s`` (waiting, running, KV usage, block size). A pod that fails
``unhealthy_after`` checks in a row leaves the candidate set at once; after ``forget_after_s``
unhealthy its prefix-index entries are dropped (``on_forget``), since whatever it held may be gone.
Only the vLLM metric names the router needs are parsed, with a small line scanner rather than a
full exposition parser, because this runs four times a second per pod.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from router.config import PodConfig

log = logging.getLogger("kvroute.pods")


@dataclass
class PodState:
    config: PodConfig
    healthy: bool = False
    ready: bool = True  # discovery's verdict (Kubernetes Ready, not terminating); static pods always
    checked: bool = False
    failures: int = 0
    unhealthy_since: float | None = None
    forgotten: bool = False
    waiting: int = 0             # waiting for capacity (vLLM's waiting less its deferred ones)
    waiting_deferred: int = 0    # waiting for something else, chiefly a NIXL read (vLLM's reason="deferred")
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    last_scrape: float | None = None
    scrape_errors: int = 0
    id: str = field(init=False, repr=False)  # config.id, read several times per pod in every decision
    # the LoRA adapters it serves: its lora_adapters, then what its /v1/models lists (router/adapters.py)
    adapters: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.id = self.config.id
        self.adapters = frozenset(self.config.lora_adapters)


@dataclass
class PodMetrics:
    waiting: float = 0.0
    # vllm:num_requests_waiting_by_reason{reason="deferred"} (vLLM >= 0.32): waiting requests held back
    # by transient constraints, chiefly decode requests waiting for their KV over NIXL; they are counted
    # in vllm:num_requests_waiting but need none of the pod's prefill capacity (None: not reported)
    deferred: float | None = None
    running: float = 0.0
    kv_usage: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    engines: int = 0  # vllm:cache_config_info series on the page: one per engine its server fronts
    seen: set[str] = field(default_factory=set)


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip().lstrip(",").strip()
        if eq + 1 >= len(text) or text[eq + 1] != '"':
            break
        j = eq + 2
        val = []
        while j < len(text) and text[j] != '"':
            if text[j] == "\\" and j + 1 < len(text):
                j += 1
            val.append(text[j])
            j += 1
        out[key] = "".join(val)
        i = j + 1
    return out


def parse_vllm_metrics(text: str, engine: str | None = None) -> PodMetrics:
    """The load signals of a vLLM /metrics page, summed over engines (DP ranks), or those of one
    engine (its ``engine`` label) when ``engine`` is given.

    vLLM's API server puts the sum of its engines' KV blocks in ``vllm:cache_config_info`` under
    every engine's label (its client adds each engine's ``num_gpu_blocks`` as the engine reports
    ready), so one engine's share is that sum over the number of engine labels on the page."""
    m = PodMetrics()
    tag = f'engine="{engine}"' if engine is not None else None
    kv_new: list[float] = []
    kv_old: list[float] = []
    engines = 0  # cache_config_info series: one per engine the server fronts
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            close = line.rfind("}")
            labels_text, rest = line[brace + 1:close], line[close + 1:]
        else:
            name, _, rest = line.partition(" ")
            labels_text = ""
        if name == "vllm:cache_config_info":
            engines += 1
        if tag is not None and tag not in labels_text:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if not 0.0 <= value < math.inf:  # NaN, infinite or negative: no load signal (int(nan) would raise)
            continue
        if name == "vllm:num_requests_waiting":
            m.waiting += value
        elif name == "vllm:num_requests_waiting_by_reason":
            if _labels(labels_text).get("reason") == "deferred":
                m.deferred = (m.deferred or 0.0) + value
        elif name == "vllm:num_requests_running":
            m.running += value
        elif name == "vllm:kv_cache_usage_perc":
            kv_new.append(value)
        elif name == "vllm:gpu_cache_usage_perc":
            kv_old.append(value)
        elif name == "vllm:cache_config_info":
            labels = _labels(labels_text)
            try:
                m.block_size = int(labels["block_size"])
            except (KeyError, ValueError):
                pass
            try:
                m.num_gpu_blocks = int(labels["num_gpu_blocks"])
            except (KeyError, ValueError):
                pass
        else:
            continue
        m.seen.add(name)
    kv = kv_new or kv_old
    if kv:
        m.kv_usage = sum(kv) / len(kv)
    if tag is not None and m.num_gpu_blocks and engines > 1:
        m.num_gpu_blocks //= engines
    m.engines = engines
    return m


class PodRegistry:
    """Owns every pod's state; the only writer is its own polling tasks."""

    def __init__(self, pods: Iterable[PodConfig], *, scrape_interval_s: float = 0.25,
                 health_interval_s: float = 1.0, timeout_s: float = 1.0, unhealthy_after: int = 2,
                 forget_after_s: float = 30.0, on_forget: Callable[[str], None] | None = None,
                 on_health_change: Callable[[str, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.pods: dict[str, PodState] = {p.id: PodState(p) for p in pods}
        self.scrape_interval_s = scrape_interval_s
        self.health_interval_s = health_interval_s
        self.timeout_s = timeout_s
        self.unhealthy_after = max(1, unhealthy_after)
        self.forget_after_s = forget_after_s
        self.on_forget = on_forget
        self.on_health_change = on_health_change
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._pages: dict[str, tuple[float, asyncio.Future[str]]] = {}  # metrics URL -> (fetched at, page)
        self._models: list[str] | None = None  # models()' answer until the membership changes
        self._adapters: dict[str, str] | None = None  # adapters()' answer until membership or adapters change

    # ---- queries -------------------------------------------------------------------------
    def healthy(self) -> list[PodState]:
        return [p for p in self.pods.values() if p.healthy and p.ready]

    def models(self) -> list[str]:
        """The base models the fleet's pods serve, in the order they joined (kept until a pod joins
        or leaves: several lookups per request read it)."""
        if self._models is None:
            self._models = list(dict.fromkeys(p.config.model for p in self.pods.values()))
        return list(self._models)

    def serves_model(self, model: str) -> bool:
        return model in (self._models if self._models is not None else self.models())

    def adapters(self) -> dict[str, str]:
        """LoRA adapter name -> the base model of the pods that serve it (the first pod's, if they
        differ); kept until a pod joins or leaves or its adapters change."""
        if self._adapters is None:
            out: dict[str, str] = {}
            for p in self.pods.values():
                for name in sorted(p.adapters):
                    out.setdefault(name, p.config.model)
            self._adapters = out
        return self._adapters

    def serving(self, model: str, adapter: str | None = None) -> list[PodState]:
        """Healthy pods of ``model`` (and, for an adapter's request, serving that adapter)."""
        return [p for p in self.healthy()
                if p.config.model == model and (adapter is None or adapter in p.adapters)]

    def set_adapters(self, pod_id: str, adapters: frozenset[str]) -> None:
        """The LoRA adapters a pod says it serves now (its /v1/models: router/adapters.py)."""
        pod = self.pods.get(pod_id)
        if pod is None or pod.adapters == adapters:
            return
        added, dropped = sorted(adapters - pod.adapters), sorted(pod.adapters - adapters)
        pod.adapters = adapters
        self._adapters = None
        log.info("pod %s: LoRA adapters%s%s", pod_id, f" loaded {', '.join(added)}" if added else "",
                 f" unloaded {', '.join(dropped)}" if dropped else "")

    def block_size(self) -> int | None:
        """The block size the pods report (the most common one), if any has reported."""
        sizes = [p.block_size for p in self.pods.values() if p.block_size]
        return max(set(sizes), key=sizes.count) if sizes else None

    # ---- state changes -------------------------------------------------------------------
    def mark(self, pod_id: str, ok: bool) -> None:
        """Record a health observation (a check, or a failed connection from dispatch)."""
        pod = self.pods.get(pod_id)
        if pod is None:
            return
        pod.checked = True
        was = pod.healthy
        if ok:
            pod.failures = 0
            pod.healthy = True
            pod.unhealthy_since = None
            pod.forgotten = False
        else:
            pod.failures += 1
            if pod.failures >= self.unhealthy_after:
                pod.healthy = False
                if pod.unhealthy_since is None:
                    pod.unhealthy_since = self._clock()
        if was != pod.healthy:
            log.log(logging.INFO if pod.healthy else logging.WARNING, "pod %s is now %s", pod_id,
                    "healthy" if pod.healthy else "unhealthy")
            if self.on_health_change:
                self.on_health_change(pod_id, pod.healthy)
        if (not pod.healthy and not pod.forgotten and pod.unhealthy_since is not None
                and self._clock() - pod.unhealthy_since >= self.forget_after_s):
            pod.forgotten = True
            if self.on_forget:
                self.on_forget(pod_id)

    def apply_metrics(self, pod_id: str, m: PodMetrics) -> None:
        pod = self.pods.get(pod_id)
        if pod is None:  # left the fleet while the scrape was in flight
            return
        # the queue ahead of a new prompt: what waits for capacity, not for a KV transfer
        pod.waiting_deferred = int(m.deferred or 0)
        pod.waiting = max(0, int(m.waiting) - pod.waiting_deferred)
        pod.running = int(m.running)
        if m.kv_usage is not None:
            pod.kv_usage = m.kv_usage
        if m.block_size:
            pod.block_size = m.block_size
        if m.num_gpu_blocks:
            pod.num_gpu_blocks = m.num_gpu_blocks
        pod.last_scrape = self._clock()

    def scrape_age(self, pod: PodState) -> float | None:
        """Seconds since the pod's /metrics was last read and applied (None before the first read). Its
        load signals are that old: a pod whose /metrics fails while /health passes keeps its last ones."""
        return None if pod.last_scrape is None else max(0.0, self._clock() - pod.last_scrape)

    # ---- polling -------------------------------------------------------------------------
    async def check_health(self, pod: PodState) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(pod.config.url + "/health") as resp:
                await resp.read()
                ok = resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            ok = False
        self.mark(pod.id, ok)
        return ok

    async def _fetch_metrics(self, url: str) -> str:
        assert self._session is not None
        async with self._session.get(url) as resp:
            if resp.status != 200:
                raise aiohttp.ClientError(f"status {resp.status}")
            return await resp.text()

    async def _shared_metrics(self, url: str) -> str:
        """One fetch of ``url`` per half scrape interval, shared by every engine of a data-parallel pod
        (they are scraped as pods of their own, all from their server's one page: without this a
        4-engine pod was fetched and rendered four times as often, which on a busy pod delayed its
        engines enough to mislead their calibration)."""
        now = self._clock()
        hit = self._pages.get(url)
        if hit is None or now - hit[0] >= self.scrape_interval_s / 2:
            if len(self._pages) > 4 * max(1, len(self.pods)):  # pods came and went
                self._pages.clear()
            hit = (now, asyncio.ensure_future(self._fetch_metrics(url)))
            self._pages[url] = hit
        return await asyncio.shield(hit[1])

    async def scrape(self, pod: PodState) -> bool:
        assert self._session is not None
        config, rank = pod.config, pod.config.dp_rank
        # external-lb: each rank's API server has a page of its own (not steered: rank 0's, where a
        # sidecar sends a request that names no rank); else the pod's one page, for every engine
        own = config.metrics_urls[rank or 0] if config.metrics_urls else None
        url = (own or config.metrics_url or config.url) + "/metrics"
        try:
            text = await (self._shared_metrics(url) if rank is not None else self._fetch_metrics(url))
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
            pod.scrape_errors += 1
            return False
        engine = None if rank is None else str(config.data_parallel_start_rank + rank)
        if own is None:
            m = parse_vllm_metrics(text, engine)
        else:
            # a rank's own server fronts its one engine, labelled with its global rank (vLLM's external-lb,
            # MoE models) or "0" (a dense model's independent per-rank servers: vLLM refuses external-lb DP
            # for those): the whole page is the rank's. A page of several engines is filtered as before.
            m = parse_vllm_metrics(text)
            if m.engines > 1 and engine is not None:
                m = parse_vllm_metrics(text, engine)
        self.apply_metrics(pod.id, m)
        return True

    async def refresh_all(self) -> None:
        """One health check and one scrape of every pod, concurrently (used at start-up)."""
        await asyncio.gather(*(self.check_health(p) for p in self.pods.values()))
        await asyncio.gather(*(self.scrape(p) for p in self.pods.values() if p.healthy))

    async def _loop(self, fn, pod: PodState, interval: float) -> None:
        while True:
            started = time.monotonic()
            try:
                await fn(pod)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one pod's oddity stop the loop
                log.exception("poll of pod %s failed", pod.id)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        await self.refresh_all()
        for pod in self.pods.values():
            self._poll(pod)

    def _poll(self, pod: PodState) -> None:
        if pod.id in self._tasks:  # joined while start-up was checking the others: already polled
            return
        self._tasks[pod.id] = [asyncio.create_task(self._loop(self.check_health, pod, self.health_interval_s)),
                               asyncio.create_task(self._loop(self.scrape, pod, self.scrape_interval_s))]

    # ---- membership at run time (discovery) ----------------------------------------------
    def add(self, config: PodConfig, ready: bool = True) -> PodState:
        """A pod joins: it is polled at once and becomes a candidate after its first good check."""
        if config.id in self.pods:
            raise ValueError(f"pod {config.id} is already in the fleet")
        pod = PodState(config, ready=ready)
        self.pods[config.id] = pod
        self._models = self._adapters = None
        if self._session is not None:
            self._poll(pod)
        return pod

    def set_ready(self, pod_id: str, ready: bool) -> None:
        pod = self.pods.get(pod_id)
        if pod is not None and pod.ready != ready:
            pod.ready = ready
            log.info("pod %s is now %s by discovery", pod_id, "ready" if ready else "not ready")

    def remove(self, pod_id: str) -> PodState | None:
        """A pod leaves: it stops being a candidate at once and its polling stops."""
        pod = self.pods.pop(pod_id, None)
        self._models = self._adapters = None
        for t in self._tasks.pop(pod_id, []):
            t.cancel()
        return pod

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
