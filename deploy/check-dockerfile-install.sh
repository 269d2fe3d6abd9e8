#!/usr/bin/env bash
# Run the Dockerfile's build stage, step by step, on this machine, in a fresh virtual environment.
#
# No container engine runs in CI, so this is how CI proves the image's install steps work: it reads
# the stage named "build" from the Dockerfile, copies what its COPY instructions name into a scratch
# directory (the stage's WORKDIR), applies its ENV lines, and runs each RUN instruction there with
# `sh -ec`, exactly as written, except that $VENV points into the scratch directory instead of
# /opt/kvroute. It then smoke-tests the result: every subcommand answers --help and the version
# matches pyproject.toml. Exits non-zero on the first failing step.
#
#   deploy/check-dockerfile-install.sh [--keep] [PYTHON]
#
# PYTHON (default: python3) must be the image's Python minor version (3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
keep=0
if [[ "${1:-}" == "--keep" ]]; then keep=1; shift; fi
python_bin="${1:-python3}"
scratch="$(mktemp -d -t kvroute-dockerfile-XXXXXX)"
if [[ $keep == 0 ]]; then trap 'rm -rf "$scratch"' EXIT; fi
echo "scratch directory: $scratch"

"$python_bin" - "$scratch" <<'PY'
import os, re, shlex, shutil, subprocess, sys
from pathlib import Path

scratch = Path(sys.argv[1])
repo = Path.cwd()
text = Path("Dockerfile").read_text()

# Join continuation lines, drop comments and blanks, split into (INSTRUCTION, arguments).
logical, current = [], ""
for raw in text.splitlines():
    line = raw.rstrip()
    if not current and (not line.strip() or line.lstrip().startswith("#")):
        continue
    if line.endswith("\\"):
        current += line[:-1] + " "
        continue
    logical.append(current + line)
    current = ""
instructions = [(l.split(None, 1)[0].upper(), l.split(None, 1)[1].strip() if len(l.split(None, 1)) > 1 else "")
                for l in (x.strip() for x in logical)]

stage, in_build = [], False
for op, args in instructions:
    if op == "FROM":
        in_build = bool(re.search(r"\bAS\s+build\s*$", args, re.I))
        continue
    if in_build:
        stage.append((op, args))
if not stage:
    sys.exit("Dockerfile has no stage named 'build'")

workdir = scratch / "src"
workdir.mkdir()
venv = scratch / "venv"
env = dict(os.environ)
# The image's `python` is the interpreter this check runs under.
bindir = scratch / "bin"
bindir.mkdir()
(bindir / "python").symlink_to(sys.executable)
env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
ran = 0
for op, args in stage:
    if op == "ENV":
        for token in shlex.split(args):
            key, _, value = token.partition("=")
            env[key] = value
        env["VENV"] = str(venv)
    elif op == "WORKDIR":
        pass  # the scratch src directory stands for it
    elif op == "COPY":
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        *sources, dest = parts
        for src in sources:
            source = repo / src
            target = workdir / dest
            if dest.endswith("/") or dest in (".", "./") or len(sources) > 1:
                target = target / Path(src).name
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
            else:
                shutil.copy2(source, target)
        print(f"COPY {args}", flush=True)
    elif op == "RUN":
        print(f"RUN {args}", flush=True)
        subprocess.run(["sh", "-ec", args], cwd=workdir, env=env, check=True)
        ran += 1
    elif op in ("ARG", "LABEL"):
        pass
    else:
        sys.exit(f"check-dockerfile-install: no rule for {op} in the build stage; teach this script")
if ran == 0:
    sys.exit("the build stage has no RUN step")
(scratch / "venv-path").write_text(str(venv))
PY

venv="$scratch/venv"
version="$("$venv/bin/kvroute" --version)"
expected="kvroute $("$python_bin" -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')"
if [[ "$version" != "$expected" ]]; then
  echo "installed version '$version' != '$expected'" >&2; exit 1
fi
# Every service the image is for must at least import and print its help.
for cmd in serve sidecar sim replay events demo simulate plan; do
  if ! out="$(cd "$scratch" && "$venv/bin/kvroute" "$cmd" --help 2>&1)"; then
    echo "kvroute $cmd --help failed in the image's environment:" >&2
    echo "$out" | tail -20 >&2
    exit 1
  fi
done
echo "Dockerfile install steps OK: $version, $(wc -l < <("$venv/bin/pip" freeze)) packages"
