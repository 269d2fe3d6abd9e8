"""What every bench's JSON summary records about the run that made it, and the peers' pinned versions.

``stamp(script, argv)``: the command (``python bench/<script> ARGS``), the commit of this checkout
(``git rev-parse HEAD``, read only) with whether tracked files differed from it, and the date.
``PINNED``: the peer routers' versions the benches are run with; ``check_peer`` says when the
venv holds another one, so a table's row label does not claim a version that did not run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}


def commit(tree: str | Path = ROOT) -> str | None:
    """``tree``'s HEAD commit, with ``+dirty`` when its tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(tree), "diff-index", "--quiet", "HEAD", "--"],
                               capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def stamp(script: str, argv: list[str] | None = None) -> dict:
    """``{"command", "commit", "date"}`` for a JSON summary; ``argv`` defaults to ``sys.argv[1:]``."""
    args = sys.argv[1:] if argv is None else argv
    return {"command": " ".join(["python", f"bench/{script}", *args]), "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def peer_version(venv: str | Path, dist: str) -> str:
    """The version of ``dist`` installed in ``venv``, or "not installed"."""
    try:
        out = subprocess.run([str(Path(venv) / "bin" / "python"), "-c",
                              f"import importlib.metadata as m; print(m.version({dist!r}))"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "not installed"
    return out.stdout.strip() or "not installed"


def check_peer(dist: str, version: str) -> bool:
    """Print a warning when ``version`` is not the pinned one; True when it is."""
    want = PINNED.get(dist)
    if want is None or version in (want, "not installed"):
        return True
    print(f"  WARNING: {dist} {version} installed, the benches pin {want} "
          f"(pip install {dist}=={want})", flush=True)
    return False
