"""Deployment review: what the platform team is paged for. Each test pins one finding.

- NetworkPolicies: the booking bus, KV events and NIXL are reachable only from the pods that use them
  (evaluated on the rendered overlays with NetworkPolicy's own matching rules).
- The HPA owns the router count; the PodDisruptionBudget lets one replica go at a time at any scale.
- Model pods carry no service-account token.
- An alert fires when no router target is up at all (not only when a scraped one answers 0).

Renders with ``kubectl kustomize`` and runs ``promtool``, as tests/test_deploy_*.py do: e2e tier.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.test_deploy_kubernetes import KUBERNETES, OVERLAYS, by_kind, one, render, tool, workloads

pytestmark = pytest.mark.e2e

ROUTER = {"app.kubernetes.io/name": "kvroute-router"}
OUTSIDE = None  # a pod of another namespace, or a client outside the cluster


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(KUBERNETES / "overlays" / name) for name in OVERLAYS}


# ---------------------------------------------------------------------------------------------
# NetworkPolicy, evaluated as the API documents it (ingress only; policies are additive)
# ---------------------------------------------------------------------------------------------

def label_selects(selector: dict, labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"Exists": key in labels, "DoesNotExist": key not in labels,
              "In": labels.get(key) in values, "NotIn": key not in labels or labels[key] not in values}[op]
        if not ok:
            return False
    return True


def peer_admits(peer: dict, source: dict[str, str] | None) -> bool:
    """One ``from`` entry against a source: a pod of this namespace (its labels) or OUTSIDE."""
    if "ipBlock" in peer:
        return True  # any address range is taken to include the source: the strict reading for a denial
    if "namespaceSelector" in peer:
        return source is OUTSIDE or label_selects(peer.get("podSelector", {}), source)
    if source is OUTSIDE:
        return False
    return label_selects(peer.get("podSelector", {}), source)


def port_admits(rule_port: dict, template: dict, port: int) -> bool:
    want = rule_port.get("port")
    if want is None:
        return True
    if isinstance(want, str):  # a named port: the destination pod's container port of that name
        named = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
                 if p.get("name") == want}
        return port in named
    return want <= port <= rule_port.get("endPort", want)


def reachable(docs: list[dict], template: dict, port: int, source: dict[str, str] | None) -> bool:
    """Whether ``source`` may open a TCP connection to ``port`` of a pod of ``template``."""
    labels = template["metadata"]["labels"]
    policies = [p for p in by_kind(docs, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and label_selects(p["spec"]["podSelector"], labels)]
    if not policies:
        return True  # no policy selects the pod: every source reaches every port
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            froms = rule.get("from")
            ports = rule.get("ports")
            if (froms is None or any(peer_admits(peer, source) for peer in froms)) and \
                    (ports is None or any(port_admits(rp, template, port) for rp in ports)):
                return True
    return False


def ports_named(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
            if p.get("name")}


def test_policy_evaluator_reads_the_api_rules():
    """The evaluator is not a rubber stamp: the cases the API documents."""
    template = {"metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"ports": [{"name": "web", "containerPort": 80}]}]}}
    assert reachable([], template, 5570, OUTSIDE)
    deny_all = {"kind": "NetworkPolicy", "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert not reachable([deny_all], template, 80, {"a": "b"})
    web = {"kind": "NetworkPolicy", "spec": {"podSelector": {"matchLabels": {"a": "b"}},
                                             "ingress": [{"ports": [{"port": "web"}]}]}}
    assert reachable([deny_all, web], template, 80, OUTSIDE)
    assert not reachable([deny_all, web], template, 81, {"a": "b"})
    peers = {"kind": "NetworkPolicy", "spec": {"podSelector": {}, "ingress": [
        {"from": [{"podSelector": {"matchExpressions": [{"key": "p", "operator": "Exists"}]}}]}]}}
    assert reachable([peers], template, 9999, {"p": ""}) and not reachable([peers], template, 9999, {"q": ""})
    assert not reachable([peers], template, 9999, OUTSIDE)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_keep_bus_events_and_nixl_to_the_pods_that_use_them(overlay, rendered):
    """Without a NetworkPolicy every pod of the cluster reaches the routers' booking bus (5570: it
    reads every replica's bookings and, with no CURVE key, publishes bookings the routers apply), the
    model pods' KV events and replay (5557/5558: every prompt's block hashes) and vLLM's NIXL side
    channel and KV transfers (the KV cache itself). HTTP stays open: clients, and Prometheus in
    whatever namespace it runs."""
    docs = rendered[overlay]
    router = one(docs, "Deployment", "kvroute-router")["spec"]["template"]
    models = [w["spec"]["template"] for w in workloads(docs)
              if "kvroute.io/pool" in w["spec"]["template"]["metadata"]["labels"]]
    assert models
    rports = ports_named(router)
    # the router: its API from anywhere, the booking bus only from the other replicas
    assert reachable(docs, router, rports["http"], OUTSIDE)
    assert reachable(docs, router, rports["booking-bus"], router["metadata"]["labels"])
    assert not reachable(docs, router, rports["booking-bus"], OUTSIDE)
    for m in models:
        assert not reachable(docs, router, rports["booking-bus"], m["metadata"]["labels"])
    assert not reachable(docs, router, rports["booking-bus"], {"app.kubernetes.io/name": "replay"})
    for m in models:
        ports = ports_named(m)
        role = m["metadata"]["labels"]["kvroute.io/role"]
        # HTTP (requests, /metrics) from anywhere: the routers, the sidecars' prefill legs, Prometheus
        for name in ("http", "vllm"):
            if name in ports:
                assert reachable(docs, m, ports[name], OUTSIDE), (role, name)
        # KV events and replay: from the routers (every data-parallel rank's port), from no one else
        for name in ("kv-events", "kv-replay"):
            assert reachable(docs, m, ports[name], router["metadata"]["labels"]), (role, name)
            assert reachable(docs, m, ports[name] + 3, router["metadata"]["labels"]), (role, name)
            assert not reachable(docs, m, ports[name], OUTSIDE), (role, name)
            assert not reachable(docs, m, ports[name], {"app.kubernetes.io/name": "replay"}), (role, name)
        # NIXL: the side channel and UCX's own TCP ports, between model pods only
        others = [o["metadata"]["labels"] for o in models]
        for port in [p for n, p in ports.items() if n == "nixl"] + [40123]:
            assert all(reachable(docs, m, port, o) for o in others), (role, port)
            assert not reachable(docs, m, port, OUTSIDE), (role, port)
        assert reachable(docs, m, 40123, router["metadata"]["labels"])  # a data-parallel sidecar rank's port
    # every policy selects pods of this overlay
    templates = [router, *models]
    for p in by_kind(docs, "NetworkPolicy"):
        assert any(label_selects(p["spec"]["podSelector"], t["metadata"]["labels"]) for t in templates), \
            p["metadata"]["name"]


# ---------------------------------------------------------------------------------------------
# Replicas, disruptions, tokens
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_replica_count_is_left_to_the_hpa(overlay, rendered):
    """With ``spec.replicas`` in the manifest, every ``kubectl apply`` (a router.yaml change rolls
    out that way) scales the Deployment back to it: 6 replicas the HPA added at peak become 2 at
    once (Kubernetes' HPA documentation: remove spec.replicas when an HPA is enabled)."""
    docs = rendered[overlay]
    dep = one(docs, "Deployment", "kvroute-router")
    hpa = one(docs, "HorizontalPodAutoscaler", "kvroute-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert "replicas" not in dep["spec"], dep["spec"].get("replicas")
    assert hpa["spec"]["minReplicas"] >= 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_pdb_lets_one_replica_go_at_a_time_at_any_scale(overlay, rendered):
    """minAvailable 1 allows (replicas - 1) evictions at once: at the HPA's 6, a drain of several
    nodes could leave one replica with the load of six. The budget must allow one eviction at the
    HPA's minimum (drains are not blocked) and no more than one at its maximum."""
    docs = rendered[overlay]
    hpa = one(docs, "HorizontalPodAutoscaler", "kvroute-router")
    pdb = one(docs, "PodDisruptionBudget", "kvroute-router")["spec"]

    def allowed(replicas: int) -> int:
        if "maxUnavailable" in pdb:
            return int(pdb["maxUnavailable"])
        return replicas - int(pdb["minAvailable"])

    assert allowed(hpa["spec"]["minReplicas"]) == 1
    assert allowed(hpa["spec"]["maxReplicas"]) == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_pods_mount_no_service_account_token(overlay, rendered):
    """vLLM, the sidecar and the simulator never call the Kubernetes API; the default token would
    sit in a pod that runs model code and takes prompts from the network."""
    for w in workloads(rendered[overlay]):
        spec = w["spec"]["template"]["spec"]
        if w["metadata"]["name"] == "kvroute-router":
            continue  # pod discovery reads the API with it
        assert spec.get("automountServiceAccountToken") is False, w["metadata"]["name"]


# ---------------------------------------------------------------------------------------------
# Alerts
# ---------------------------------------------------------------------------------------------

NO_ROUTER_TEST = """
rule_files:
  - alerts.yml
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # the last router target disappears (its pod Pending or evicted: the scrape configs keep
      # only Running pods, so there is no `up` series left that could be 0)
      - series: 'up{job="kvroute-router", kubernetes_pod_name="router-a"}'
        values: '1 1 1 _x12'
      - series: 'up{job="vllm", pod="vllm-0"}'
        values: '1x15'
    alert_rule_test:
      - eval_time: 12m
        alertname: KvrouteRouterDown
        exp_alerts: []
"""


def test_an_alert_fires_when_no_router_target_exists_at_all(tmp_path):
    """KvrouteRouterDown needs ``up == 0``; with every router pod gone there is no ``up`` series and
    no alert. Some critical alert must fire then, and none while a router is up."""
    shutil.copy(KUBERNETES.parent / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    rules = yaml.safe_load((tmp_path / "alerts.yml").read_text())["groups"]
    critical = [r["alert"] for g in rules for r in g["rules"] if r.get("labels", {}).get("severity") == "critical"]
    promtool = tool("promtool")

    def fires(alert: str, eval_time: str, gone: bool) -> bool:
        """Whether ``alert`` is firing at ``eval_time``: a promtool test that expects it silent fails."""
        text = NO_ROUTER_TEST.replace("'1 1 1 _x12'", "'1 1 1 _x12'" if gone else "'1x15'")
        text = text.replace("eval_time: 12m", f"eval_time: {eval_time}").replace(
            "alertname: KvrouteRouterDown", f"alertname: {alert}")
        (tmp_path / "case.test.yml").write_text(text)
        out = subprocess.run([promtool, "test", "rules", "case.test.yml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert "SUCCESS" in out.stdout or "FAILED" in out.stdout + out.stderr, out.stdout + out.stderr
        return out.returncode != 0

    assert not fires("KvrouteRouterDown", "12m", gone=True)  # the gap this test is about
    paged = [a for a in critical if fires(a, "12m", gone=True)]
    assert paged, f"no critical alert fires when every router target is gone (critical: {critical})"
    assert not [a for a in paged if fires(a, "12m", gone=False)], paged
