"""Prometheus and Grafana: the shipped configs pass promtool, the alert rules fire when they should,
every metric the rules and the dashboard name is one the services really export, the Operator
objects point at ports the manifests declare, and a real Prometheus server with the shipped
Kubernetes scrape config finds and labels the router, sidecar and model-pod targets.

The exported names come from live processes on loopback (``kvroute serve``, ``kvroute sidecar``,
``kvroute sim``) scraped at test time; a second ``kvroute serve`` finds the same simulated pod through
DNS discovery (a stub DNS server on loopback UDP), since only a router with discovery on exports the
``kvroute_discovery_*`` series. promtool and prometheus come from Debian's ``prometheus``
package (.ci/run installs it); a missing binary fails the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ROOT, free_ports, kvroute_process, stop_process, wait_http
from tests.test_discovery_dns import StubDNS

PROM = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute-dashboard.json"
RUNBOOK = ROOT / "docs" / "runbook.md"

PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                "bool", "offset", "inf", "nan"}


def binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed; make test installs it (deploy/system-deps.sh: Debian package "
                    "'prometheus', or the 'test' extra)")
    return found


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def render(path: Path) -> list[dict]:
    out = run([binary("kubectl"), "kustomize", str(path)])
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (strings, matchers, ranges, groupings removed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    s = re.sub(r"\$\{?\w+\}?", "", s)
    found = re.findall(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![a-zA-Z0-9_:])(?!\s*\()", s)
    return {n for n in found if n.lower() not in PROMQL_WORDS}


def exported(text: str) -> set[str]:
    """Every series name a /metrics exposition can produce (histogram and counter suffixes included)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        if fam.type == "counter":
            names |= {fam.name + "_total", fam.name + "_created"}
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        elif fam.type == "summary":
            names |= {fam.name + s for s in ("_sum", "_count", "_created")}
        names |= {s.name for s in fam.samples}
    return names


def alert_rules(path: Path = PROM / "alerts.yml") -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def runbook_sections() -> dict[str, str]:
    """docs/runbook.md's ``## `` headings -> the text under each, up to the next one."""
    parts = re.split(r"^## (.+)$", RUNBOOK.read_text(), flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_metric_names(text: str) -> set[str]:
    """The metric names a runbook section mentions: kvroute's own, vLLM's (``vllm:``) and ``up{...}``."""
    return set(re.findall(r"(?<![\w:./-])(kvroute_[a-z0-9_]+|vllm:[a-z0-9_:]+|up(?=\{))", text))


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


# ---------------------------------------------------------------------------------------------
# A live fleet on loopback: one simulated pod, a sidecar in front of it, a router over it.
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def stub_dns(records: dict[str, list[str]], port: int):
    """StubDNS (tests/test_discovery_dns.py) answering on 127.0.0.1:port from its own event loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="stub-dns", daemon=True)
    thread.start()
    try:
        transport, stub = asyncio.run_coroutine_threadsafe(
            loop.create_datagram_endpoint(StubDNS, local_addr=("127.0.0.1", port)), loop).result(10)
        stub.records = records
        try:
            yield stub
        finally:
            loop.call_soon_threadsafe(transport.close)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def tiny_tokenizer(folder: Path) -> Path:
    """A small byte-level BPE saved as tokenizer.json: a Hugging Face tokenizer gives the router its
    tokenize process (and its series)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world, the router routes prompts"] * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    sim_port, events_port, replay_port, sidecar_port, router_port, dns_router_port, dns_port, bus_port = free_ports(8)
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    sim_url = f"http://127.0.0.1:{sim_port}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@sim-0@sim-model"}
    with kvroute_process(["sim", "--port", str(sim_port), "--kv-events-config", json.dumps(events)],
                         ready_url=f"{sim_url}/health"):
        with kvroute_process(["sidecar", "--host", "127.0.0.1", "--port", str(sidecar_port), "--vllm-url", sim_url],
                             ready_url=f"http://127.0.0.1:{sidecar_port}/health"):
            pods = [{"id": "sim-0", "url": sim_url, "role": "both",
                     "kv_events": [{"endpoint": f"tcp://127.0.0.1:{events_port}",
                                    "replay": f"tcp://127.0.0.1:{replay_port}"}]}]
            # a Hugging Face tokenizer (its tokenize process) and a booking-bus port of its own (a
            # replica whose peers are not up), so the series the alerts on those read are exported
            with kvroute_process(["serve", "--port", str(router_port), "--pods", json.dumps(pods),
                                  "--tokenizer", str(tokenizer), "--booking-bus-bind", f"tcp://127.0.0.1:{bus_port}"],
                                 ready_url=f"http://127.0.0.1:{router_port}/ready"):
                router_url = f"http://127.0.0.1:{router_port}"
                # One routed request, so labelled series have samples too.
                r = httpx.post(f"{router_url}/v1/completions", timeout=30,
                               json={"model": "sim-model", "prompt": "hello " * 40, "max_tokens": 4})
                assert r.status_code == 200, r.text
                dns_discovery = ["--discovery", "dns", "--discovery-dns-name", "sim.kvroute.test",
                                 "--discovery-dns-server", f"127.0.0.1:{dns_port}", "--discovery-model", "sim-model",
                                 "--discovery-http-port", str(sim_port), "--discovery-kv-events-port", str(events_port),
                                 "--discovery-kv-events-replay-port", str(replay_port)]
                with stub_dns({"sim.kvroute.test": ["127.0.0.1"]}, dns_port), \
                        kvroute_process(["serve", "--port", str(dns_router_port), *dns_discovery],
                                        ready_url=f"http://127.0.0.1:{dns_router_port}/ready"):
                    yield {"router": router_url, "sidecar": f"http://127.0.0.1:{sidecar_port}", "sim": sim_url,
                           "router_dns_discovery": f"http://127.0.0.1:{dns_router_port}"}


@pytest.fixture(scope="module")
def exported_names(live) -> dict[str, set[str]]:
    names = {}
    for service, url in live.items():
        r = httpx.get(f"{url}/metrics", timeout=10)
        assert r.status_code == 200
        names[service] = exported(r.text)
    names["prometheus"] = {"up"}  # synthesized by Prometheus for every target
    return names


# ---------------------------------------------------------------------------------------------
# promtool
# ---------------------------------------------------------------------------------------------

def test_alert_rules_pass_promtool_check():
    out = run([binary("promtool"), "check", "rules", "alerts.yml"], cwd=PROM)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


def test_alert_rules_unit_tests_pass():
    """alerts.test.yml feeds synthetic series and states which alerts fire, with which text."""
    out = run([binary("promtool"), "test", "rules", "alerts.test.yml"], cwd=PROM)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROM / "alerts.test.yml").read_text()))
    assert tested >= {"KvrouteHighErrorRate", "KvrouteHighRejectionRate", "KvrouteKVEventLag",
                      "KvroutePodWithoutKVEvents", "KvroutePodMetricsStale", "KvrouteTTFTPredictionError",
                      "KvrouteRouterDown", "KvrouteNoRouterUp",
                      "KvrouteDiscoveryStale", "KvrouteDiscoveryErrors", "KvrouteDiscoveryNoReadyPods",
                      "KvrouteTokenizeProcessDown", "KvrouteTokenizeProcessRestarts", "KvrouteBookingBusIsolated"}


def test_alert_rule_unit_tests_catch_a_broken_threshold(tmp_path):
    """The unit tests are not vacuous: loosening the error-rate threshold makes them fail."""
    shutil.copy(PROM / "alerts.test.yml", tmp_path)
    text = (PROM / "alerts.yml").read_text()
    assert "> 0.05" in text
    (tmp_path / "alerts.yml").write_text(text.replace("> 0.05", "> 0.5"))
    out = run([binary("promtool"), "test", "rules", "alerts.test.yml"], cwd=tmp_path)
    assert out.returncode != 0 and "KvrouteHighErrorRate" in out.stdout + out.stderr


def test_static_scrape_config_passes_promtool_check():
    out = run([binary("promtool"), "check", "config", "prometheus-static.yml"], cwd=PROM)
    assert out.returncode == 0, out.stdout + out.stderr


def kubernetes_config_with_file_sd(directory: Path, targets_file: Path, interval: str | None = None) -> Path:
    """prometheus.yml with each kubernetes_sd_configs replaced by file_sd_configs reading targets_file.

    Debian's Prometheus is built without Kubernetes service discovery, so promtool cannot parse
    kubernetes_sd_configs; everything else (jobs, relabel rules, rule files) is kept as shipped.
    """
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    swapped = 0
    for job in config["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
            swapped += 1
    assert swapped == len(config["scrape_configs"])
    if interval:
        config["global"]["scrape_interval"] = interval
        config["global"]["evaluation_interval"] = interval
    shutil.copy(PROM / "alerts.yml", directory / "alerts.yml")
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_kubernetes_scrape_config_passes_promtool_check(tmp_path):
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    path = kubernetes_config_with_file_sd(tmp_path, targets)
    out = run([binary("promtool"), "check", "config", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_operator_rule_is_generated_from_alerts_yml_and_passes_promtool(tmp_path):
    out = run([sys.executable, str(PROM / "make_prometheusrule.py"), "--check"])
    assert out.returncode == 0, out.stderr
    rule = yaml.safe_load((PROM / "operator" / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    extracted = tmp_path / "rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = run([binary("promtool"), "check", "rules", str(extracted)])
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# Metric names
# ---------------------------------------------------------------------------------------------

def test_promql_name_extraction():
    assert metric_names('sum by (pod) (rate(kvroute_requests_total{status=~"5..", pod!=""}[5m])) '
                        '/ on (pod) group_left max(vllm:num_requests_waiting) > 0.5') == {
        "kvroute_requests_total", "vllm:num_requests_waiting"}
    assert metric_names("histogram_quantile(0.9, sum by (le) (rate(x_bucket[$__rate_interval])))") == {"x_bucket"}
    assert metric_names('up{job="kvroute-router"} == 0') == {"up"}


def test_only_the_router_with_discovery_on_exports_discovery_series(exported_names):
    """Why the live fleet has a second router: a static fleet has no discovery series at all."""
    discovery = {n for n in exported_names["router_dns_discovery"] if n.startswith("kvroute_discovery_")}
    assert {"kvroute_discovery_pods", "kvroute_discovery_errors_total", "kvroute_discovery_relists_total",
            "kvroute_discovery_last_sync_age_seconds"} <= discovery
    assert not {n for n in exported_names["router"] if n.startswith("kvroute_discovery_")}


def test_every_metric_in_the_alert_rules_is_exported(exported_names):
    known = set().union(*exported_names.values())
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= known, f"{rule['alert']} reads metrics nobody exports: {sorted(names - known)}"


def test_every_alert_has_a_runbook_section_and_links_to_it():
    """The on-call engineer lands on docs/runbook.md#<alert name in lower case> from the alert itself:
    every alert carries that runbook_url, every alert has its section there (and no section is left
    for an alert that is gone), and each says what to check and what to do."""
    sections = runbook_sections()
    rules = alert_rules()
    assert sorted(sections) == sorted(r["alert"] for r in rules)
    for rule in rules:
        name = rule["alert"]
        assert github_anchor(name) == name.lower()
        assert rule["annotations"].get("runbook_url") == f"docs/runbook.md#{name.lower()}", name
        text = sections[name]
        for part in ("**Means.**", "**Likely causes.**", "**Check first.**", "**Do.**"):
            assert part in text, f"runbook section {name} has no {part}"
        assert runbook_metric_names(text), f"runbook section {name} names no metric to check"
    operator = yaml.safe_load((PROM / "operator" / "prometheusrule.yaml").read_text())
    assert all(r["annotations"]["runbook_url"] for g in operator["spec"]["groups"] for r in g["rules"])


def test_runbook_metric_name_extraction():
    assert runbook_metric_names("`kvroute_pod_healthy{pod=\"x\"}`, `rate(vllm:num_preemptions_total[5m])`, "
                                "kvroute.io/pool, kvroute-router, KVROUTE_BOOKING_BUS_PORT, `kvroute_made_up`, "
                                'is up, `up{job="vllm"}`') == {
        "kvroute_pod_healthy", "vllm:num_preemptions_total", "kvroute_made_up", "up"}


def test_every_metric_the_runbook_names_is_exported(exported_names):
    """A runbook that tells the on-call engineer to query a series nobody exports wastes the night."""
    known = set().union(*exported_names.values())
    for name, text in runbook_sections().items():
        unknown = runbook_metric_names(text) - known
        assert not unknown, f"runbook section {name} names metrics nobody exports: {sorted(unknown)}"
    head = RUNBOOK.read_text().split("\n## ", 1)[0]
    assert not runbook_metric_names(head) - known


def test_every_metric_on_the_dashboard_is_exported(exported_names):
    known = set().union(*exported_names.values())
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= known, f"dashboard query reads metrics nobody exports: {sorted(names - known)}\n{expr}"
        used |= names
    # The dashboard covers what it promises: traffic, TTFT predicted vs observed, hit rate,
    # rejections, per-pod load, event lag, discovery (pods by state, relists, watch restarts, errors).
    assert {"kvroute_requests_total", "kvroute_predicted_ttft_seconds_bucket", "kvroute_observed_ttft_seconds_bucket",
            "vllm:prefix_cache_hits_total", "kvroute_rejections_total", "vllm:num_requests_waiting",
            "kvroute_pod_event_lag_seconds", "kvroute_discovery_pods", "kvroute_discovery_relists_total",
            "kvroute_discovery_watch_restarts_total", "kvroute_discovery_errors_total"} <= used


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] == "kvroute"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert p["targets"] and all(t["refId"] for t in p["targets"])


def test_dashboard_configmap_renders_validates_and_carries_the_dashboard(tmp_path):
    docs = render(ROOT / "deploy" / "grafana")
    assert [d["kind"] for d in docs] == ["ConfigMap"]
    cm = docs[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvroute-dashboard.json"]) == json.loads(DASHBOARD.read_text())
    path = tmp_path / "grafana.yaml"
    path.write_text(yaml.safe_dump(cm))
    out = run([binary("kubernetes-validate"), "--strict", str(path)])
    assert out.returncode == 0 and "passed for resource" in out.stdout + out.stderr, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# The Operator objects against the manifests
# ---------------------------------------------------------------------------------------------

def selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "Exists" and expr["key"] not in labels:
            return False
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_operator_monitors_find_the_ports_the_manifests_declare():
    monitors = {d["metadata"]["name"]: d for d in render(ROOT / "deploy" / "prometheus" / "operator")}
    assert set(monitors) == {"kvroute-router", "kvroute-sidecar", "vllm", "kvroute"}
    for overlay in ("vllm-pd", "vllm-aggregated", "simulated"):
        docs = render(ROOT / "deploy" / "kubernetes" / "overlays" / overlay)
        pods = [(w["spec"]["template"], w["metadata"]["name"])
                for w in docs if w["kind"] in ("Deployment", "StatefulSet")]
        # Router: the ServiceMonitor selects the router Service, whose port it names.
        sm = monitors["kvroute-router"]["spec"]
        services = [d for d in docs if d["kind"] == "Service" and selects(sm["selector"], d["metadata"]["labels"])]
        assert [s["metadata"]["name"] for s in services] == ["kvroute-router"]
        assert sm["endpoints"][0]["port"] in {p["name"] for p in services[0]["spec"]["ports"]}
        # Model pods: the vllm PodMonitor selects every pod of the pool and its port exists on each.
        pm = monitors["vllm"]["spec"]
        model = [(t, n) for t, n in pods if "kvroute.io/pool" in t["metadata"]["labels"]]
        selected = [n for t, n in pods if selects(pm["selector"], t["metadata"]["labels"])]
        assert model and selected == [n for _, n in model]
        for t, name in model:
            ports = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
            assert pm["podMetricsEndpoints"][0]["port"] in ports, name
        # Sidecars: exactly the decode pods, on the sidecar container's port.
        sc = monitors["kvroute-sidecar"]["spec"]
        chosen = [(t, n) for t, n in pods if selects(sc["selector"], t["metadata"]["labels"])]
        for t, name in chosen:
            sidecar = next(c for c in t["spec"]["containers"] if c["name"] == "sidecar")
            assert sc["podMetricsEndpoints"][0]["port"] in {p["name"] for p in sidecar["ports"]}, name
        assert bool(chosen) == (overlay == "vllm-pd")


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str]:
    """Prometheus target relabeling (replace, keep, labeldrop), rules in the Operator's camelCase."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        regex = re.compile(f"^(?:{rule.get('regex', '(.*)')})$")
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule.get("sourceLabels", []))
        if action == "labeldrop":
            labels = {k: v for k, v in labels.items() if not regex.match(k)}
        elif action == "keep":
            if not regex.match(value):
                return {}
        elif action == "replace":
            m = regex.match(value)
            if m:
                labels[rule["targetLabel"]] = m.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return labels


def test_router_service_monitor_keeps_the_routers_own_pod_label():
    """The Operator puts namespace, service, pod and container target labels on every ServiceMonitor
    target before the endpoint's own relabelings, and without honorLabels a target label renames the
    scraped label of the same name (``exported_pod``): the router's ``pod`` (the model pod its
    kvroute_pod_* and kvroute_requests_total series describe) would become the replica's name, and
    every ``by (pod)`` alert and panel would group router replicas."""
    endpoint = yaml.safe_load((PROM / "operator" / "servicemonitor-router.yaml").read_text())["spec"]["endpoints"][0]
    meta = {"__meta_kubernetes_namespace": "kvroute", "__meta_kubernetes_service_name": "kvroute-router",
            "__meta_kubernetes_pod_name": "kvroute-router-7d9f-abcde", "__meta_kubernetes_pod_container_name": "router"}
    operator = [{"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
                {"sourceLabels": ["__meta_kubernetes_service_name"], "targetLabel": "service"},
                {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod"},
                {"sourceLabels": ["__meta_kubernetes_pod_container_name"], "targetLabel": "container"},
                {"targetLabel": "endpoint", "replacement": endpoint["port"]}]
    target = {k: v for k, v in relabel(meta, operator + endpoint.get("relabelings", [])).items()
              if not k.startswith("__")}
    assert target["kubernetes_pod_name"] == "kvroute-router-7d9f-abcde" and target["job"] == "kvroute-router"
    # every label the router's series carry themselves wins over the target's
    router_labels = {"pod", "policy", "status", "reason", "cause", "kind", "state", "change", "outcome"}
    assert endpoint.get("honorLabels") or not router_labels & set(target), sorted(router_labels & set(target))


# ---------------------------------------------------------------------------------------------
# A real Prometheus with the shipped Kubernetes scrape config
# ---------------------------------------------------------------------------------------------

def sanitize(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_name(workload: dict, i: int) -> str:
    """The name Kubernetes would give pod ``i`` of a workload (a Deployment's has a hash in it)."""
    name = workload["metadata"]["name"]
    return f"{name}-{i}" if workload["kind"] == "StatefulSet" else f"{name}-abc12-{i}"


def replicas(docs: list[dict], workload: dict) -> int:
    """How many pods a workload runs: its ``replicas``, or its HPA's minimum when the HPA owns the count."""
    if "replicas" in workload["spec"]:
        return workload["spec"]["replicas"]
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"
            and d["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]]
    return hpas[0]["spec"]["minReplicas"] if hpas else 1


def pod_target_names(docs: list[dict], name: str) -> set[str]:
    w = next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == name)
    return {pod_name(w, i) for i in range(replicas(docs, w))}


def pod_targets(docs: list[dict], address_for) -> list[dict]:
    """What Kubernetes pod discovery would produce for the rendered pods: one target per container
    port, with the __meta_kubernetes_* labels Prometheus documents, at an address we choose."""
    groups = []
    for w in docs:
        if w["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = w["spec"]["template"]
        for i in range(replicas(docs, w)):
            pod = pod_name(w, i)
            for c in template["spec"]["containers"]:
                for port in c.get("ports", []):
                    labels = {f"__meta_kubernetes_pod_label_{sanitize(k)}": v
                              for k, v in template["metadata"]["labels"].items()}
                    labels.update({
                        "__meta_kubernetes_namespace": w["metadata"]["namespace"],
                        "__meta_kubernetes_pod_name": pod,
                        "__meta_kubernetes_pod_phase": "Running",
                        "__meta_kubernetes_pod_container_name": c["name"],
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    })
                    groups.append({"targets": [address_for(c["name"], port.get("name"))], "labels": labels})
    return groups


def test_real_prometheus_with_the_kubernetes_config_scrapes_router_sidecar_and_pods(live, tmp_path):
    docs = render(ROOT / "deploy" / "kubernetes" / "overlays" / "vllm-pd")
    host = {name: url.removeprefix("http://") for name, url in live.items()}

    def address_for(container: str, port_name: str | None) -> str:
        if port_name == "http":
            return host["router"] if container == "router" else host["sidecar"]
        if port_name == "vllm":
            return host["sim"]
        return "127.0.0.1:9"  # event, replay and NIXL ports: must not be scraped at all

    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps(pod_targets(docs, address_for)))
    config = kubernetes_config_with_file_sd(tmp_path, targets, interval="1s")
    (port,) = free_ports(1)
    proc = subprocess.Popen([binary("prometheus"), f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        wait_http(f"http://127.0.0.1:{port}/-/ready", timeout=30, proc=proc)

        def query(q: str) -> list[dict]:
            r = httpx.get(f"{api}/query", params={"query": q}, timeout=5)
            assert r.status_code == 200, r.text
            return r.json()["data"]["result"]

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            up = query("up")
            if len(up) == 8 and all(s["value"][1] == "1" for s in up) and query("kvroute_pod_healthy"):
                break
            time.sleep(0.5)
        up = {(s["metric"]["job"], s["metric"].get("kubernetes_pod_name") or s["metric"].get("pod")): s
              for s in query("up")}
        # 2 router replicas, 2 sidecars (decode pods), 4 vLLM endpoints (2 prefill + 2 decode);
        # no event, replay or NIXL port became a target.
        assert sorted(j for j, _ in up) == ["kvroute-router"] * 2 + ["kvroute-sidecar"] * 2 + ["vllm"] * 4, up
        assert all(s["value"][1] == "1" for s in up.values()), up
        decode, prefill = pod_target_names(docs, "vllm-decode"), pod_target_names(docs, "vllm-prefill")
        assert len(decode) == len(prefill) == 2
        assert {p for j, p in up if j == "kvroute-sidecar"} == decode
        assert {p for j, p in up if j == "vllm"} == prefill | decode
        # Model-pod series carry pod and role; router series keep their own `pod` label intact.
        waiting = query('vllm:num_requests_waiting{job="vllm", role="decode"}')
        assert {s["metric"]["pod"] for s in waiting} == decode
        healthy = query('kvroute_pod_healthy{job="kvroute-router"}')
        assert {s["metric"]["pod"] for s in healthy} == {"sim-0"}
        assert all(s["metric"]["kubernetes_pod_name"].startswith("kvroute-router-") for s in healthy)
        assert all(s["metric"]["kubernetes_namespace"] == "kvroute" for s in healthy)
        # The rules file loaded and every rule evaluates without error.
        rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
        loaded = [r for g in rules for r in g["rules"]]
        assert len(loaded) == len(alert_rules())
        assert all(r["health"] in ("ok", "unknown") for r in loaded), [(r["name"], r.get("lastError")) for r in loaded]
    finally:
        stop_process(proc)


def test_the_routing_time_histogram_resolves_slow_decisions():
    """The dashboard's routing p99 is histogram_quantile over kvroute_routing_seconds: with 0.1 s as
    the highest bucket, a 0.3 s or a 2 s decision (a big prompt tokenized on the loop, a stalled
    loop) both read as 0.1 s."""
    from router.metrics import RouterMetrics

    def p99(seconds: float) -> float:
        m = RouterMetrics()
        for _ in range(100):
            m.routing_seconds.observe(seconds)
        bounds = [float(s.labels["le"]) for fam in m.registry.collect() if fam.name == "kvroute_routing_seconds"
                  for s in fam.samples if s.name.endswith("_bucket") and s.value >= 99]
        return min(bounds)  # the bucket histogram_quantile interpolates in (+Inf: its highest finite bound)

    assert p99(0.001) <= 0.001
    assert 0.25 <= p99(0.3) <= 0.5
    assert 1.0 <= p99(2.0) < float("inf")
