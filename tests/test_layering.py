"""Package layering: the router never imports the simulator, the replay client or the simulated-fleet
trials; the sidecar and the simulated pod never import the router. What they share is in kvcommon/.

Each check imports the modules in a fresh interpreter and looks at ``sys.modules`` afterwards, so a
lazy import inside a function is not caught, but every module-level one (and anything it pulls in) is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

_LOADED = """
import importlib, json, pkgutil, sys
roots = {roots!r}
for root in roots:
    package = importlib.import_module(root)
    for info in pkgutil.walk_packages(package.__path__, root + "."):
        importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_after_importing(*roots: str) -> set[str]:
    """The modules loaded after importing every module of the packages ``roots`` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _LOADED.format(roots=list(roots))], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _under(modules: set[str], *packages: str) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in packages)


def test_the_router_imports_neither_the_simulator_nor_replay_nor_fleet():
    loaded = loaded_after_importing("router")
    assert "router.serve" in loaded and "router.api" in loaded  # the walk did import the router
    assert _under(loaded, "simulator", "replay", "fleet", "sidecar") == []


@pytest.mark.parametrize("package", ["sidecar", "simulator"])
def test_the_sidecar_and_the_simulator_do_not_import_the_router(package):
    loaded = loaded_after_importing(package)
    assert f"{package}.cli" in loaded
    assert _under(loaded, "router", "fleet") == []


def test_kvcommon_imports_none_of_the_services():
    loaded = loaded_after_importing("kvcommon")
    assert "kvcommon.asgi" in loaded
    assert _under(loaded, "router", "sidecar", "simulator", "replay", "fleet", "indexer") == []
