"""Kubernetes discovery against a small fake API server that speaks list and watch, with real
simulated pods behind the pod objects: discovered pods are health-checked, served and indexed from
their own KV events, and pods that go (deleted, not Ready, or silently vanished) leave the fleet.

The fake API server keeps a resourceVersion counter and an event log like the real one: a list
answers the current pods and version; a watch streams the log after the given version as JSON lines
(ADDED/MODIFIED/DELETED, BOOKMARK on request) and then waits for more; a version older than the
compaction point answers 410 Gone. Tests can drop every open watch, delete a pod without telling
anyone, and compact the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from kvcommon.settings import build_settings
from router.config import RouterSettings
from router.discovery.kubernetes import is_ready, pod_from_object
from simulator.testing import consecutive_free_ports, running_sims
from tests.helpers import free_port, until
from tests.test_router_api import running_router

NAMESPACE = "kvroute"
TOKEN = "test-token-123"


class FakeKube:
    """List and watch of pods in one namespace, over real HTTP on loopback."""

    def __init__(self, ssl_context=None) -> None:
        self.ssl_context = ssl_context
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1000
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted = 0
        self.changed = asyncio.Event()
        self.open_watches: dict[int, web.Request] = {}
        self.lists = 0
        self.watches = 0
        self.refuse_next_watch_with_410 = False
        self.fail_next_watches = 0
        self.end_watches_at_once = False
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.ssl_context).start()

    async def stop(self) -> None:
        self.drop_watches()
        if self.runner:
            await self.runner.cleanup()

    # ---- what tests do ---------------------------------------------------------------------
    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.log.append((self.version, kind, copy.deepcopy(obj)))
        self.changed.set()
        self.changed = asyncio.Event()

    def put(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        self.pods[name] = obj
        self._record(kind, obj)

    def delete(self, name: str, tell_watchers: bool = True) -> None:
        obj = self.pods.pop(name)
        if tell_watchers:
            self._record("DELETED", obj)
        else:
            self.version += 1  # the change happened; no watcher will hear of it

    def drop_watches(self) -> None:
        """Cut every open watch connection (an API server restart or a proxy idle timeout)."""
        for request in list(self.open_watches.values()):
            if request.transport is not None:
                request.transport.close()
        self.open_watches.clear()
        self.changed.set()
        self.changed = asyncio.Event()

    def compact(self) -> None:
        """Forget the event log: a watch from any version seen so far is now too old (410 Gone)."""
        self.compacted = self.version
        self.log.clear()

    # ---- the API -----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        if request.match_info["ns"] != NAMESPACE:
            return web.json_response({"kind": "Status", "code": 403}, status=403)
        selector = dict(term.split("=", 1) for term in request.query.get("labelSelector", "").split(",") if term)

        def selected(obj: dict[str, Any]) -> bool:
            labels = obj["metadata"].get("labels") or {}
            return all(labels.get(k) == v for k, v in selector.items())

        if request.query.get("watch") not in ("1", "true"):
            self.lists += 1
            items = [copy.deepcopy(o) for o in self.pods.values() if selected(o)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items})
        self.watches += 1
        since = int(request.query.get("resourceVersion") or self.version)
        if self.fail_next_watches:
            self.fail_next_watches -= 1
            return web.Response(status=500, text="etcdserver: request timed out")
        if self.refuse_next_watch_with_410:
            self.refuse_next_watch_with_410 = False
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"}, status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if self.end_watches_at_once:  # a proxy or API server that closes every watch stream at once
            return resp
        if since < self.compacted:
            status = {"kind": "Status", "status": "Failure", "code": 410, "reason": "Expired",
                      "message": f"too old resource version: {since} ({self.compacted})"}
            await resp.write(orjson.dumps({"type": "ERROR", "object": status}) + b"\n")
            return resp
        self.open_watches[id(request)] = request
        deadline = time.monotonic() + float(request.query.get("timeoutSeconds", 30))
        try:
            while time.monotonic() < deadline and id(request) in self.open_watches:
                changed = self.changed
                for version, kind, obj in [e for e in self.log if e[0] > since]:
                    since = version
                    if selected(obj):
                        await resp.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")
                if request.query.get("allowWatchBookmarks") == "true":
                    await resp.write(orjson.dumps({"type": "BOOKMARK", "object": {
                        "kind": "Pod", "metadata": {"resourceVersion": str(self.version)}}}) + b"\n")
                    since = max(since, self.version)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), max(0.01, min(1.0, deadline - time.monotonic())))
        except (ConnectionResetError, RuntimeError):
            pass
        finally:
            self.open_watches.pop(id(request), None)
        return resp


def pod_object(name: str, url: str, events_port: int, *, ready: bool = True, role: str = "both",
               pool: str = "default", terminating: bool = False) -> dict[str, Any]:
    port = url.rsplit(":", 1)[1]
    meta: dict[str, Any] = {
        "name": name, "namespace": NAMESPACE,
        "labels": {"app.kubernetes.io/name": "sim", "kvroute.io/pool": pool, "kvroute.io/role": role},
        "annotations": {"kvroute.io/model": "sim-model", "kvroute.io/http-port": port,
                        "kvroute.io/engine-port": port, "kvroute.io/kv-events-port": str(events_port),
                        "kvroute.io/kv-events-replay-port": str(events_port + 1),
                        "kvroute.io/data-parallel-size": "1"}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta,
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def settings_for(kube: FakeKube, token_file, **kw) -> RouterSettings:
    base = dict(port=free_port(), discovery="kubernetes", discovery_api_server=kube.url, discovery_namespace=NAMESPACE,
                discovery_token_file=str(token_file), discovery_relist_s=60.0, discovery_watch_timeout_s=30,
                health_interval_s=0.1, scrape_interval_s=0.1, health_timeout_s=0.5, unhealthy_after=1,
                speculative_ttl_s=0.1, log_level="warning")
    base.update(kw)
    return build_settings(RouterSettings, base)


def candidates(services) -> set[str]:
    return {p.id for p in services.registry.healthy()}


@pytest.fixture(scope="module")
def sims():
    events = consecutive_free_ports(6)
    with running_sims(3, ["--timing", "seed", "--kv-events-port", str(events), "--block-size", "16"]) as urls:
        yield [(url, events + 2 * i) for i, url in enumerate(urls)]


@pytest.fixture
async def kube():
    k = FakeKube()
    await k.start()
    yield k
    await k.stop()


@pytest.fixture
def token(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# the pod object -> the router's view
# ---------------------------------------------------------------------------------------------


def test_pod_object_gives_role_model_ports_and_event_streams():
    obj = pod_object("vllm-decode-7", "http://x:8000", 5557, role="decode")
    obj["metadata"]["annotations"].update({"kvroute.io/engine-port": "8001", "kvroute.io/kv-events-replay-port": "5560",
                                           "kvroute.io/data-parallel-size": "2"})
    obj["status"]["podIP"] = "10.1.2.3"
    pod = pod_from_object(obj)
    assert pod is not None and pod.ready
    c = pod.config
    assert (c.id, c.url, c.role, c.model) == ("vllm-decode-7", "http://10.1.2.3:8000", "decode", "sim-model")
    assert c.metrics_url == "http://10.1.2.3:8001"  # the engine behind the sidecar reports the load
    assert [(e.endpoint, e.replay) for e in c.kv_events] == [("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5560"),
                                                             ("tcp://10.1.2.3:5558", "tcp://10.1.2.3:5561")]
    obj["status"]["podIP"] = "fd00::5"
    assert pod_from_object(obj).config.url == "http://[fd00::5]:8000"
    # a later node of a multi-node data-parallel deployment: vLLM offsets its ports by the global rank
    obj["metadata"]["annotations"]["kvroute.io/data-parallel-start-rank"] = "4"
    c = pod_from_object(obj).config
    assert (c.data_parallel_size, c.data_parallel_start_rank) == (2, 4)
    assert [e.endpoint for e in c.kv_events] == ["tcp://[fd00::5]:5561", "tcp://[fd00::5]:5562"]


def test_readiness_comes_from_conditions_phase_and_deletion():
    assert is_ready(pod_object("a", "http://x:1", 2))
    assert not is_ready(pod_object("a", "http://x:1", 2, ready=False))
    assert not is_ready(pod_object("a", "http://x:1", 2, terminating=True))
    pending = pod_object("a", "http://x:1", 2)
    pending["status"]["phase"] = "Pending"
    assert not is_ready(pending)
    no_conditions = pod_object("a", "http://x:1", 2)
    del no_conditions["status"]["conditions"]
    assert not is_ready(no_conditions)


def test_pods_that_cannot_be_routed_to_are_skipped():
    no_ip = pod_object("a", "http://x:1", 2)
    del no_ip["status"]["podIP"]
    no_model = pod_object("a", "http://x:1", 2)
    del no_model["metadata"]["annotations"]["kvroute.io/model"]
    bad_role = pod_object("a", "http://x:1", 2, role="chef")
    bad_port = pod_object("a", "http://x:1", 2)
    bad_port["metadata"]["annotations"]["kvroute.io/http-port"] = "http"
    finished = pod_object("a", "http://x:1", 2)
    finished["status"]["phase"] = "Succeeded"
    not_an_ip = []  # skipped, never raised (a re-list with one of them failed whole) nor turned into a URL
    for ip in ("10.0.0.1/evil", "10.0.0.1:99", "host name", "999.1.1.1"):
        obj = pod_object("a", "http://x:1", 2)
        obj["status"]["podIP"] = ip
        not_an_ip.append(obj)
    for obj in (no_ip, no_model, bad_role, bad_port, finished, *not_an_ip):
        assert pod_from_object(obj) is None
    v6 = pod_object("a", "http://x:1", 2)
    v6["status"]["podIP"] = "fd00::5"
    assert pod_from_object(v6).config.url == "http://[fd00::5]:1"


# ---------------------------------------------------------------------------------------------
# against the fake API server, with real simulated pods
# ---------------------------------------------------------------------------------------------


async def test_discovered_pods_are_served_indexed_and_leave_when_not_ready_or_deleted(sims, kube, token):
    (url_a, ev_a), (url_b, ev_b), _ = sims
    kube.put(pod_object("sim-a", url_a, ev_a))
    kube.put(pod_object("other-pool", url_b, ev_b, pool="canary"))  # not ours: the selector leaves it out
    async with running_router(settings_for(kube, token)) as (base, services):
        assert set(services.registry.pods) == {"sim-a"}
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            body = {"model": "sim-model", "prompt": "Discovered pods serve. " * 30, "max_tokens": 4}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "sim-a"
            # its KV events reach the index (speculative credit expires after 0.1 s)
            await until(lambda: (services.index.pod_stats("sim-a") or {}).get("blocks", 0) > 0, what="sim-a events")

            kube.put(pod_object("sim-b", url_b, ev_b))  # a new pod: joins, is checked, takes traffic
            await until(lambda: candidates(services) == {"sim-a", "sim-b"}, what="sim-b joins")
            assert services.index.has_pod("sim-b")

            kube.put(pod_object("sim-a", url_a, ev_a, ready=False))  # NotReady: out of the candidate set
            await until(lambda: candidates(services) == {"sim-b"}, what="sim-a not ready")
            assert services.index.has_pod("sim-a")  # its cache is still known, for when it is back
            for _ in range(3):
                r = await c.post("/v1/completions", json=body)
                assert r.headers["x-kvroute-pod"] == "sim-b"
            explained = (await c.post("/debug/route", json=body)).json()
            assert [p["pod"] for p in explained["pods"]] == ["sim-b"]

            kube.put(pod_object("sim-a", url_a, ev_a, terminating=True))  # Ready but terminating: still out
            kube.put(pod_object("sim-a", url_a, ev_a))
            await until(lambda: "sim-a" in candidates(services), what="sim-a ready again")

            kube.delete("sim-a")  # deleted: out of the fleet, the index and the subscriber
            await until(lambda: "sim-a" not in services.registry.pods, what="sim-a deleted")
            assert not services.index.has_pod("sim-a")
            assert not any(key.startswith("sim-a@") for key in services.subscriber.stats())
            r = await c.post("/v1/completions", json=body)
            assert r.headers["x-kvroute-pod"] == "sim-b"

            metrics = (await c.get("/metrics")).text
            assert 'kvroute_discovery_pods{state="ready"} 1.0' in metrics
            assert 'kvroute_discovery_changes_total{change="leave"} 1.0' in metrics
            assert 'kvroute_discovery_changes_total{change="join"} 2.0' in metrics


async def test_a_dropped_watch_is_watched_again_and_converges(sims, kube, token):
    (url_a, ev_a), (url_b, ev_b), _ = sims
    kube.put(pod_object("sim-a", url_a, ev_a))
    async with running_router(settings_for(kube, token)) as (base, services):
        await until(lambda: kube.open_watches, what="a watch")
        lists = kube.lists
        kube.drop_watches()
        kube.put(pod_object("sim-b", url_b, ev_b))  # happens while no watch is open
        await until(lambda: candidates(services) == {"sim-a", "sim-b"}, what="sim-b after the drop")
        kube.drop_watches()
        kube.delete("sim-a")
        await until(lambda: set(services.registry.pods) == {"sim-b"}, what="sim-a gone after the drop")
        assert kube.lists == lists  # the re-watch from the last version caught up, no re-list needed
        assert services.fleet_sync.stats.watch_restarts >= 2


async def test_a_missed_delete_is_repaired_by_the_periodic_relist(sims, kube, token):
    (url_a, ev_a), (url_b, ev_b), _ = sims
    kube.put(pod_object("sim-a", url_a, ev_a))
    kube.put(pod_object("sim-b", url_b, ev_b))
    async with running_router(settings_for(kube, token, discovery_relist_s=0.5)) as (base, services):
        await until(lambda: candidates(services) == {"sim-a", "sim-b"}, what="both pods")
        relists = services.fleet_sync.stats.relists
        kube.delete("sim-a", tell_watchers=False)  # the watch never hears of it
        took = await until(lambda: "sim-a" not in services.registry.pods, timeout=3.0, what="the re-list")
        assert services.fleet_sync.stats.relists > relists
        assert not services.index.has_pod("sim-a")
        print(f"missed DELETE repaired after {took:.2f}s (relist every 0.5 s)")


async def test_410_gone_makes_the_router_relist(sims, kube, token):
    (url_a, ev_a), (url_b, ev_b), (url_c, ev_c) = sims
    kube.put(pod_object("sim-a", url_a, ev_a))
    async with running_router(settings_for(kube, token)) as (base, services):
        await until(lambda: kube.open_watches, what="a watch")
        lists = kube.lists
        # changes while disconnected, then the log is compacted: the router's version is too old
        kube.drop_watches()
        kube.delete("sim-a")
        kube.put(pod_object("sim-b", url_b, ev_b))
        kube.compact()
        await until(lambda: set(services.registry.pods) == {"sim-b"}, what="re-list after ERROR 410")
        assert kube.lists > lists and services.fleet_sync.stats.gone >= 1
        # the other form: the watch request itself answered 410
        kube.refuse_next_watch_with_410 = True
        kube.drop_watches()
        kube.put(pod_object("sim-c", url_c, ev_c))
        await until(lambda: set(services.registry.pods) == {"sim-b", "sim-c"}, what="re-list after HTTP 410")
        assert services.fleet_sync.stats.gone >= 2
        await until(lambda: candidates(services) == {"sim-b", "sim-c"}, what="both healthy")


async def test_a_refused_token_is_counted_and_the_router_still_starts(kube, tmp_path):
    bad = tmp_path / "token"
    bad.write_text("wrong")
    settings = settings_for(kube, bad)
    from router.discovery.kubernetes import KubernetesDiscovery
    from router.service import Services

    services = Services(settings)
    assert isinstance(services.discovery, KubernetesDiscovery)
    services.discovery.first_sync_timeout_s = 0.5
    await services.start()
    try:
        assert services.registry.pods == {}
        assert services.fleet_sync.stats.errors.get("http_401", 0) >= 1
        metrics = services.metrics.exposition().decode()
        assert 'kvroute_discovery_errors_total{kind="http_401"}' in metrics
    finally:
        await services.stop()


async def test_kvroute_serve_with_kubernetes_discovery_from_flags(sims, kube, token):
    """The real command: discovery settings as flags, the fleet from the fake API server."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import ROOT

    (url_a, ev_a), (url_b, ev_b), _ = sims
    kube.put(pod_object("sim-a", url_a, ev_a))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--discovery", "kubernetes",
         "--discovery-api-server", kube.url, "--discovery-namespace", NAMESPACE,
         "--discovery-token-file", str(token), "--health-interval-s", "0.1", "--unhealthy-after", "1"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as c:
            async def status(path: str) -> int:
                try:
                    return (await c.get(path)).status_code
                except httpx.HTTPError:
                    return 0

            deadline = time.monotonic() + 20
            while await status("/ready") != 200:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "router never became ready"
                await asyncio.sleep(0.1)
            body = {"model": "sim-model", "prompt": "From the command line. " * 10, "max_tokens": 2}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "sim-a"
            kube.put(pod_object("sim-b", url_b, ev_b))
            kube.delete("sim-a")
            deadline = time.monotonic() + 10
            while 'kvroute_pod_healthy{pod="sim-b"} 1.0' not in (metrics := (await c.get("/metrics")).text) \
                    or 'kvroute_pod_healthy{pod="sim-a"}' in metrics:
                assert time.monotonic() < deadline, metrics
                await asyncio.sleep(0.1)
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "sim-b"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def test_kvroute_serve_refuses_incomplete_discovery_settings():
    import subprocess
    import sys

    from tests.helpers import ROOT

    for args, message in ((["--discovery", "dns"], "discovery_dns_name"),
                          (["--discovery", "kubernetes", "--discovery-namespace", "x"], "discovery_api_server")):
        env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KUBERNETES_")}
        out = subprocess.run([sys.executable, "-m", "router.cli", "serve", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


async def test_the_api_server_certificate_is_checked_against_the_ca_file(tmp_path, token):
    """Over HTTPS the router trusts the service account's CA, and only it."""
    import ssl

    from router.service import Services
    from tests.test_sidecar import make_certificate

    cert, key = make_certificate(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    kube = FakeKube(ssl_context=ctx)
    await kube.start()
    try:
        kube.put(pod_object("sim-a", "http://127.0.0.1:9", 7))
        for ca_file, trusted in ((cert, True), (str(tmp_path / "absent-ca.crt"), False)):
            services = Services(settings_for(kube, token, discovery_ca_file=ca_file))
            services.discovery.first_sync_timeout_s = 1.0
            await services.start()
            try:
                assert set(services.registry.pods) == ({"sim-a"} if trusted else set())
                assert (services.fleet_sync.stats.errors.get("tls", 0) == 0) == trusted
            finally:
                await services.stop()
    finally:
        await kube.stop()


async def test_a_failing_watch_is_retried_with_backoff_and_converges(sims, kube, token):
    (url_a, ev_a), (url_b, ev_b), _ = sims
    kube.put(pod_object("sim-a", url_a, ev_a))
    async with running_router(settings_for(kube, token)) as (base, services):
        await until(lambda: kube.open_watches, what="a watch")
        kube.fail_next_watches = 3
        kube.drop_watches()
        kube.put(pod_object("sim-b", url_b, ev_b))
        await until(lambda: set(services.registry.pods) == {"sim-a", "sim-b"}, what="sim-b after the failures")
        assert services.fleet_sync.stats.errors.get("http_500") == 3
        assert kube.fail_next_watches == 0


async def test_a_watch_the_server_ends_at_once_is_opened_again_with_backoff_not_in_a_tight_loop(sims, kube, token):
    """A 200 watch stream that ends at once (a proxy closing it, an API server restarting) is not an
    error, but opening it again at once made thousands of watch requests a second."""
    (url_a, ev_a), (url_b, ev_b), _ = sims
    kube.put(pod_object("sim-a", url_a, ev_a))
    async with running_router(settings_for(kube, token)) as (base, services):
        await until(lambda: kube.open_watches, what="a watch")
        kube.end_watches_at_once = True
        kube.drop_watches()
        watches = kube.watches
        await asyncio.sleep(2.0)
        assert kube.watches - watches < 30, kube.watches - watches
        kube.end_watches_at_once = False
        kube.put(pod_object("sim-b", url_b, ev_b))
        await until(lambda: set(services.registry.pods) == {"sim-a", "sim-b"}, what="sim-b once watches stay open")


# ---------------------------------------------------------------------------------------------
# bursts of watch events: each applied to the pod it names, not by re-diffing the whole fleet
# ---------------------------------------------------------------------------------------------


class _BufferedWatch:
    """A 200 watch answer whose lines are all in already: aiohttp reads those without a pause."""

    status = 200

    def __init__(self, lines: list[bytes]) -> None:
        self.content = self._lines(lines)

    @staticmethod
    async def _lines(lines: list[bytes]):
        for line in lines:
            yield line

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> bool:
        return False


class _Session:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def get(self, url: str, **kw) -> _BufferedWatch:
        return _BufferedWatch(self.lines)


def _fleet_pod(i: int, *, ready: bool = True, port: str = "8000") -> dict[str, Any]:
    obj = pod_object(f"vllm-{i}", f"http://x:{port}", 5557, ready=ready)
    obj["status"]["podIP"] = f"10.0.{i // 200}.{i % 200 + 1}"
    return obj


def _rollout(m: int, n: int, version: int = 5000) -> list[bytes]:
    """n events, pod after pod: not ready, deleted, back (not ready), ready."""
    lines = []
    for k in range(n):
        i, step = (k // 4) % m, k % 4
        obj = _fleet_pod(i, ready=step == 3)
        obj["metadata"]["resourceVersion"] = str(version + k + 1)
        lines.append(orjson.dumps({"type": ("MODIFIED", "DELETED", "ADDED", "MODIFIED")[step], "object": obj}) + b"\n")
    return lines


def _discovery(m: int, expand):
    from router.discovery.fleet import FleetSync
    from router.discovery.kubernetes import KubernetesDiscovery

    calls: list[tuple] = []
    sync = FleetSync(lambda p: calls.append(("join", p.id)), lambda pid: calls.append(("leave", pid)),
                     lambda pid, r: calls.append(("ready", pid, r)), mode="kubernetes", expand=expand)
    d = KubernetesDiscovery(sync, api_server="http://127.0.0.1:1", namespace=NAMESPACE, label_selector="")
    d.pods = {p.id: p for p in (pod_from_object(_fleet_pod(i)) for i in range(m)) if p is not None}
    d.resource_version = "5000"
    sync.sync(d.pods)  # what the first list does
    calls.clear()
    return d, calls


async def test_a_burst_of_watch_events_costs_in_proportion_to_the_events_not_events_times_fleet(monkeypatch):
    """Each event re-diffed the whole fleet: N events over M pods cost N x M pod comparisons and
    expansions (1.3 ms of event loop per event at 1,000 pods). Counted, not timed."""
    import router.discovery.fleet as fleet
    from router.config import data_parallel_ranks

    m, n = 300, 600
    expanded: list[str] = []  # one entry per pod config turned into routable units
    compared = [0]  # pods handed to the diff, both sides
    real_diff = fleet.diff_fleet

    def counting_diff(current, desired):
        compared[0] += len(current) + len(desired)
        return real_diff(current, desired)

    d, calls = _discovery(m, lambda c: (expanded.append(c.id), data_parallel_ranks(c))[1])
    monkeypatch.setattr(fleet, "diff_fleet", counting_diff)
    expanded.clear()
    d._session = _Session(_rollout(m, n))
    await d.watch_once()
    assert len(expanded) <= n, f"{len(expanded)} expansions for {n} events over {m} pods"
    assert compared[0] <= 4 * n, f"{compared[0]} pods compared for {n} events over {m} pods"
    # and the outcome is the events': 150 pods each went not ready, left, came back, became ready
    assert d.resource_version == str(5000 + n)
    assert d.stats.watch_events == n
    assert sorted(d.sync.current) == sorted(d.pods) and len(d.pods) == m
    assert all(p.ready for p in d.sync.current.values())
    assert calls[:4] == [("ready", "vllm-0", False), ("leave", "vllm-0"), ("join", "vllm-0"), ("ready", "vllm-0", True)]
    assert len(calls) == n


async def test_a_buffered_burst_of_watch_events_lets_the_event_loop_run_between_slices():
    import router.discovery.kubernetes as kubernetes
    from router.config import data_parallel_ranks

    every = getattr(kubernetes, "YIELD_EVERY", 64)
    n = 20 * every
    d, _ = _discovery(100, data_parallel_ranks)
    d._session = _Session(_rollout(100, n))
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await d.watch_once()
    during = ticks - before
    task.cancel()
    assert during >= n // every - 1, during  # routing gets the loop every YIELD_EVERY events


def test_watch_events_change_the_fleet_exactly_as_a_whole_fleet_sync_would():
    """Per-pod application against the old rule (sync the whole fleet after every event), over a
    random run that includes pods losing what routing needs, terminating, finishing, bookmarks and
    data-parallel pods."""
    import random

    from router.config import data_parallel_ranks
    from router.discovery.fleet import FleetSync

    rng = random.Random(11)
    d, calls = _discovery(20, data_parallel_ranks)
    ref_calls: list[tuple] = []
    ref = FleetSync(lambda p: ref_calls.append(("join", p.id)), lambda pid: ref_calls.append(("leave", pid)),
                    lambda pid, r: ref_calls.append(("ready", pid, r)), expand=data_parallel_ranks)
    ref.sync(d.pods)
    ref_calls.clear()
    for k in range(3000):
        i = rng.randrange(30)
        obj = _fleet_pod(i, ready=rng.random() < 0.7, port=rng.choice(("8000", "8000", "8001", "http", "0")))
        ann, status = obj["metadata"]["annotations"], obj["status"]
        if rng.random() < 0.3:
            ann["kvroute.io/data-parallel-size"] = str(rng.choice((2, 3)))
        if rng.random() < 0.1:
            obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        if rng.random() < 0.05:
            status["phase"] = rng.choice(("Succeeded", "Failed", "Pending"))
        if rng.random() < 0.05:
            del status["podIP"]
        if rng.random() < 0.05:
            ann["kvroute.io/kv-events-port"] = "65535"  # its second engine's port would be 65536
        obj["metadata"]["resourceVersion"] = str(6000 + k)
        kind = rng.choice(("ADDED", "MODIFIED", "MODIFIED", "DELETED", "BOOKMARK", "WHATEVER"))
        d.apply_event({"type": kind, "object": obj})
        ref.sync(d.pods)
        assert calls == ref_calls, (k, kind, i)
        assert d.sync.current == ref.current
        assert d.resource_version == str(6000 + k)
        calls.clear()
        ref_calls.clear()
    # what an event carries is checked as before: only pods with a valid port and address are reached
    assert all(p.config.url.startswith("http://10.0.") and p.config.url.endswith((":8000", ":8001"))
               for p in d.sync.current.values())
