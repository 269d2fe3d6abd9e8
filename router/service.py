"""Wiring: builds the router's parts from settings and starts and stops them in order.

Start-up order matters: the pods are checked and scraped once first, so the block size the pods
report (``vllm:cache_config_info``) is known before the prefix index is built; then the index, the
KV-event subscriber (one endpoint per pod and DP rank), the routing core, the booking bus (shared
bookings with the other router processes, ``router/bookbus.py``) and the upstream session.
"""

from __future__ import annotations

import logging
from typing import Any

from indexer.keys import key_space
from indexer.tokens import ByteTokenizer, HFTokenizer, load_tokenizer
from kvcommon.listener import ListenerCollector
from router.adapters import AdapterCheck
from router.booking import Ledger
from router.config import RouterSettings, data_parallel_ranks
from router.discovery import DiscoveredPod, FleetSync, build_discovery
from router.discovery.fleet import DiscoveryCollector
from router.dispatch import Dispatcher
from router.event_sources import EventSourceCheck
from router.metrics import FleetCollector, IndexCollector, RouterMetrics
from router.pods import PodRegistry
from router.prompts import TokenizePool, serve_chat_flags
from router.routing import Router
from router.tokenize_proc import CacheCounts, TokenizeProcess, TokenizeProcessCollector
from router.watchdog import start_for as start_watchdog

log = logging.getLogger("kvroute")

DEFAULT_BLOCK_SIZE = 16


class Services:
    """Everything the HTTP layer needs, owned in one place; ``start``/``stop`` in the app's lifespan."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics | None = None,
                 bus_forwarder: tuple[str, str] | None = None, bus_siblings: str | None = None):
        """``bus_forwarder``: (pub, sub) endpoints of the parent's booking-bus forwarder, for a worker
        of ``kvroute serve --workers N`` beside replicas; ``bus_siblings``: the directory of the
        workers' own sockets, without replicas (router/serve.py)."""
        self.settings = settings
        self.metrics = metrics or RouterMetrics()
        self.ledger = Ledger()
        self.bus = build_bus(settings, self.ledger, bus_forwarder, bus_siblings)
        remote = settings.tokenizer == "remote"
        # remote: text and chat prompts go to a pod's /tokenize (router/remote_prompts.py); token-id
        # prompts need no tokenizer, so the local one is never asked
        self.tokenizer = ByteTokenizer() if remote else load_tokenizer(settings.tokenizer)
        # a follow-up turn tokenizes only what is new (indexer/prefix_tokens.py)
        self.prefix_tokens = self.tokenizer.cache_prefixes(max_tokens=settings.tokenize_cache_tokens,
                                                            tiktoken=settings.tokenize_tiktoken) \
            if isinstance(self.tokenizer, HFTokenizer) and settings.tokenize_cache_tokens > 0 else None
        if self.prefix_tokens is not None and self.prefix_tokens.disabled:
            log.warning("prefix token cache off, every prompt is tokenized whole: this tokenizer fails its "
                        "check (%s)", self.prefix_tokens.disabled_reason)
        if self.prefix_tokens is not None:
            if self.prefix_tokens.twin:
                log.info("tokenizing with tiktoken's BPE on the tokenizer's vocabulary (the same ids, checked)")
            elif settings.tokenize_tiktoken:
                log.info("tokenizing with the tokenizers library: tiktoken cannot stand in for this tokenizer (%s)",
                         self.prefix_tokens.twin_reason)
        # large prompts: tokenized in a child process (router/tokenize_proc.py), else in threads
        self.tokenize_process: TokenizeProcess | None = None
        if isinstance(self.tokenizer, HFTokenizer) and settings.tokenize_process:
            self.tokenize_process = TokenizeProcess(settings.tokenizer, settings.tokenize_cache_tokens,
                                                    settings.tokenize_process_timeout_s,
                                                    tiktoken=settings.tokenize_tiktoken,
                                                    chat_flags=serve_chat_flags(settings),
                                                    log_format=settings.log_format)
        if self.prefix_tokens is not None and (self.tokenize_process is not None or self.bus is not None):
            share_tokens(self.bus if settings.tokenize_cache_share else None, self.prefix_tokens,
                         self.tokenize_process)
        self.tokenize_pool = TokenizePool(settings.tokenize_threads)
        units = [u for p in settings.pods for u in data_parallel_ranks(p, settings.data_parallel_steering)]
        self.registry = PodRegistry(units, scrape_interval_s=settings.scrape_interval_s,
                                    health_interval_s=settings.health_interval_s,
                                    timeout_s=settings.health_timeout_s, unhealthy_after=settings.unhealthy_after,
                                    forget_after_s=settings.forget_after_s, on_forget=self._forget_pod)
        self.dispatcher = Dispatcher(settings.connect_timeout_s, settings.read_timeout_s,
                                     settings.max_connections, settings.max_connections_per_pod)
        self.remote_prompts: Any = None
        if remote:
            from router.remote_prompts import RemotePrompts

            self.remote_prompts = RemotePrompts(
                self.registry, lambda: self.dispatcher.client, settings.remote_tokenize_timeout_s,
                settings.remote_tokenize_cache_size,
                on_failure=lambda reason: self.metrics.tokenize_failures.labels(reason).inc(),
                exclude_tools_when_tool_choice_none=settings.exclude_tools_when_tool_choice_none)
        self.index: Any = None
        self.subscriber: Any = None
        self.router: Router | None = None
        self.started = False
        self.fleet_sync = FleetSync(self._join_pod, self._leave_pod, self.registry.set_ready, mode=settings.discovery,
                                    expand=lambda c: data_parallel_ranks(c, settings.data_parallel_steering))
        self.discovery = build_discovery(settings, self.fleet_sync)

    # ---- fleet membership at run time (discovery) ----------------------------------------
    def _join_pod(self, pod: DiscoveredPod) -> None:
        state = self.registry.add(pod.config, ready=pod.ready)
        if self.index is None:  # before start-up built the index, build_index picks it up
            return
        self.index.add_pod(pod.id, pod.config.model, approximate=not pod.config.kv_events)
        if self.subscriber is not None:
            for e in pod.config.kv_events:
                self.subscriber.add_endpoint(pod.id, e.endpoint, replay_endpoint=e.replay, topic=e.topic,
                                             one_rank=pod.config.dp_rank is not None)
        if self.router is not None:
            self.router.track_pod(state)

    def _leave_pod(self, pod_id: str) -> None:
        pod = self.registry.remove(pod_id)
        if pod is not None and self.dispatcher.client is not None:
            self.dispatcher.client.drop(pod.config.url)  # its idle connections, and its address
        if self.subscriber is not None:
            self.subscriber.remove_pod(pod_id)
        if self.index is not None:
            self.index.remove_pod(pod_id)
        if self.router is not None:
            self.router.untrack_pod(pod_id)
        # its series (pods churn, each with a new name or IP: one series per pod ever seen grows without
        # bound); an unhealthy pod keeps them (_forget_pod), since it comes back
        self.metrics.forget_pod(pod_id)
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None:
            watchdog.forget(pod_id)

    def _pod_states(self) -> dict[str, int]:
        states = {"ready": 0, "not_ready": 0, "unhealthy": 0}
        for p in self.registry.pods.values():
            states["not_ready" if not p.ready else "ready" if p.healthy else "unhealthy"] += 1
        return states

    def _forget_pod(self, pod_id: str) -> None:
        log.warning("pod %s unhealthy for %.0fs: dropping its index entries", pod_id, self.settings.forget_after_s)
        if self.index is not None:
            try:
                self.index.clear_pod(pod_id)
            except Exception:
                log.exception("clearing pod %s from the index failed", pod_id)
        if self.router is not None:
            self.router.ledger.forget(pod_id)

    def build_index(self, block_size: int) -> Any:
        from indexer.index import PrefixIndex

        index = PrefixIndex(block_size=block_size, max_blocks_per_pod=self.settings.index_max_blocks_per_pod,
                            tier_weights=dict(self.settings.tier_weights),
                            speculative_ttl_s=self.settings.speculative_ttl_s)
        for pod in (p.config for p in self.registry.pods.values()):
            index.add_pod(pod.id, pod.model, approximate=not pod.kv_events)
        return index

    async def start_subscriber(self) -> None:
        endpoints = [(p, e) for p in (s.config for s in self.registry.pods.values()) for e in p.kv_events]
        if not endpoints and self.discovery is None:
            return
        from indexer.subscriber import CurveKeys, KVEventSubscriber

        settings = self.settings
        curve = None
        if settings.kv_event_curve_server_key:
            curve = CurveKeys(settings.kv_event_curve_server_key, settings.kv_event_curve_public_key or "",
                              settings.kv_event_curve_secret_key or "")
        self.subscriber = KVEventSubscriber(self.index, max_frame_bytes=settings.kv_event_max_frame_bytes,
                                            max_replay_batches=settings.kv_event_max_replay_batches,
                                            max_replay_bytes=settings.kv_event_max_replay_bytes, curve=curve)
        for pod, e in endpoints:
            self.subscriber.add_endpoint(pod.id, e.endpoint, replay_endpoint=e.replay, topic=e.topic,
                                         one_rank=pod.dp_rank is not None)
        await self.subscriber.start()

    async def start(self) -> None:
        if self.discovery is not None:
            await self.discovery.start()  # the first list/resolution fills the registry
        await self.registry.start()
        reported = self.registry.block_size()
        block_size = self.settings.block_size or reported or DEFAULT_BLOCK_SIZE
        if self.settings.block_size and reported and reported != self.settings.block_size:
            log.warning("configured block size %d differs from the %d the pods report; prefix matches will be "
                        "wrong", self.settings.block_size, reported)
        self.index = self.build_index(block_size)
        await self.start_subscriber()
        self.watchdog = start_watchdog(self)  # silent KV-event publishers (router/watchdog.py)
        # publishers the router does not hear (router/event_sources.py)
        self.event_sources: EventSourceCheck | None = None
        if self.settings.kv_events_check_interval_s:
            self.event_sources = EventSourceCheck(self.registry, self.settings.kv_events_check_interval_s,
                                                  self.metrics.registry)
            self.event_sources.start()
        # adapters loaded and unloaded at run time (router/adapters.py)
        self.adapter_check: AdapterCheck | None = None
        if self.settings.adapters_check_interval_s:
            self.adapter_check = AdapterCheck(self.registry, self.settings.adapters_check_interval_s)
            self.adapter_check.start()
        self.router = Router(self.settings, self.registry, self.index, self.tokenizer, self.metrics,
                             ledger=self.ledger, block_size=block_size, subscriber=self.subscriber)
        if self.bus is not None:
            from router.bookbus import BusCollector

            if self.settings.booking_bus_credits:
                self.bus.key_space = key_space(block_size)
                self.bus.on_credits = self.router.credit_foreign
                self.router.on_credit = self.bus.share_credit
                self.bus.on_withdrawals = self.router.withdraw_foreign
                self.router.on_withdraw = self.bus.share_withdrawal
            await self.bus.start()
            self.metrics.add_collector(BusCollector(self.bus))
        self.metrics.add_collector(FleetCollector(self.router.pod_snapshot, self._fleet_totals))
        self.metrics.add_collector(ListenerCollector("kvroute"))
        self.metrics.add_collector(IndexCollector(self.index.stats, tuple(self.index.counters)))
        if self.tokenize_process is not None:
            await self.tokenize_process.start()  # it loads its tokenizer meanwhile; until then, the threads
            self.metrics.add_collector(TokenizeProcessCollector(self.tokenize_process))
        if self.discovery is not None:
            self.metrics.add_collector(DiscoveryCollector(self.fleet_sync, self._pod_states))
        await self.dispatcher.start()
        self.started = True

    def _fleet_totals(self) -> dict[str, float]:
        m = self.metrics
        prompt = m.prompt_tokens._value.get()
        cached = m.estimated_cached_tokens._value.get()
        totals = {"estimated_hit_rate": (cached / prompt) if prompt else 0.0,
                  "healthy_pods": float(len(self.registry.healthy()))}
        cache = self.prefix_tokens
        if cache is not None:  # tokens of long prompts taken from known prefixes rather than tokenized
            # the router's own cache (prompts tokenized here) and the tokenize process's, together
            st = cache.stats
            child = (self.tokenize_process.cache if self.tokenize_process is not None else None) or CacheCounts()
            reused = st.reused_tokens + child.reused
            seen = reused + st.tokenized_tokens + child.tokenized
            keyed = st.key_hits + st.key_misses + child.key_hits + child.key_misses
            totals.update({"tokenize_cache_hit_rate": reused / seen if seen else 0.0,
                           "tokenize_cache_reused_tokens": float(reused),
                           "tokenize_cache_held_tokens": float(cache.held_tokens + child.held),
                           "tokenize_cache_key_hit_rate": (st.key_hits + child.key_hits) / keyed if keyed else 0.0,
                           "tokenize_cache_adopted_chunks": float(st.adopted + child.adopted),
                           # follow-ups whose history a note vouched for; chunks found gone after all
                           "tokenize_cache_vouched_texts": float(st.vouched + child.vouched),
                           "tokenize_cache_vouched_missing_chunks": float(st.vouched_missing + child.vouched_missing),
                           "tokenize_cache_enabled": 0.0 if cache.disabled or child.disabled else 1.0,
                           # the child's twin counts once it has answered
                           "tokenize_tiktoken": 1.0 if cache.twin and (child.tiktoken or self.tokenize_process is None
                                                                       or self.tokenize_process.cache is None)
                           else 0.0})
        return totals

    async def stop(self) -> None:
        self.started = False
        if self.tokenize_process is not None:
            self.tokenize_process.stop()
        if self.discovery is not None:
            try:
                await self.discovery.stop()
            except Exception:
                log.exception("stopping discovery failed")
        await self.dispatcher.stop()
        if self.bus is not None:
            try:
                await self.bus.stop()
            except Exception:
                log.exception("stopping the booking bus failed")
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None:
            await watchdog.stop()
        for check in (getattr(self, "event_sources", None), getattr(self, "adapter_check", None)):
            if check is not None:
                await check.stop()
        router = getattr(self, "router", None)
        if router is not None and router.prediction_log is not None:
            router.prediction_log.close()
        if self.subscriber is not None:
            try:
                await self.subscriber.stop()
            except Exception:
                log.exception("stopping the event subscriber failed")
        await self.registry.stop()


def share_tokens(bus: Any, cache: Any, process: TokenizeProcess | None = None) -> None:
    """The router's prefix token cache and its tokenize process's keep each other's chunks (a
    conversation's turns may be tokenized in either: router/api.py). With workers or replicas
    (``bus`` not None) the chunks are shared over the booking bus too (its "t" messages): what one
    process stored (here or in its tokenize process, which loads the same tokenizer) is published,
    and another's is taken (by both) if it was cut by the same tokenizer
    (``PrefixTokenCache.fingerprint``, read once here)."""
    fingerprint = cache.fingerprint if bus is not None else ""

    def stored_here(chunks: Any) -> None:  # on the event loop or in a tokenize thread
        if process is not None:
            process.adopt(chunks)
        if bus is not None:
            bus.share_tokens(fingerprint, chunks)

    def stored_there(chunks: Any) -> None:  # in the tokenize process
        cache.adopt(chunks)
        if bus is not None:
            bus.share_tokens(fingerprint, chunks)

    cache.on_stored = stored_here
    if process is not None:
        process.share = True
        process.on_stored = stored_there
    if bus is None:
        return

    def take(fp: str, chunks: Any) -> bool:
        if fp != fingerprint:
            return False
        cache.adopt(chunks)
        if process is not None:
            process.adopt(chunks)
        return True

    bus.on_tokens = take


def build_bus(settings: RouterSettings, ledger: Ledger, forwarder: tuple[str, str] | None = None,
              siblings: str | None = None) -> Any:
    """The booking bus for ``settings`` (None when off, or when nothing else shares the fleet): for a
    worker, bound in the ``siblings`` directory and subscribed to the others there, or through the
    parent's forwarder beside replicas; else bound at ``booking_bus_bind`` and subscribed to the peers."""
    from router.bookbus import BookingBus, BusKey, bus_replicas, sibling_endpoint, sibling_endpoints

    if not settings.booking_bus or (forwarder is None and siblings is None and not bus_replicas(settings)):
        return None

    common: dict[str, Any] = dict(
        snapshot_s=settings.booking_bus_snapshot_s, peer_timeout_s=settings.booking_bus_peer_timeout_s,
        hwm=settings.booking_bus_hwm, max_bookings_per_origin=settings.booking_bus_max_bookings,
        key=BusKey.of(settings), min_interval_s=settings.booking_bus_min_interval_s)
    if siblings is not None:
        own = sibling_endpoint(siblings)
        return BookingBus(ledger, pub_bind=[own], siblings=lambda: sibling_endpoints(siblings, own), **common)

    resolve = None
    if settings.booking_bus_peers_dns:
        from router.discovery.dns import resolver_for

        resolver, name, port = resolver_for(settings), settings.booking_bus_peers_dns, settings.booking_bus_port

        async def resolve() -> list[str]:
            return [f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}" for ip in await resolver(name)]

    pub_bind = [settings.booking_bus_bind] if settings.booking_bus_bind and forwarder is None else []
    return BookingBus(ledger, pub_bind=pub_bind, pub_connect=[forwarder[0]] if forwarder else [],
                      sub_connect=([forwarder[1]] if forwarder else []) + list(settings.booking_bus_peers),
                      resolve_peers=resolve, resolve_interval_s=settings.booking_bus_peers_interval_s, **common)
