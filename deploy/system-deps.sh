#!/usr/bin/env bash
# Installs the Debian packages the tests need, only those missing; `make test` runs it first.
#
#   python3.X-venv ensurepip for $PYTHON (Debian's Python has venv but not ensurepip without it):
#                  the project's venv and the real-vLLM venv
#   prometheus     promtool and the server, for the checks of deploy/prometheus
#   openssl        the command, for the TLS tests' throwaway certificates
#   util-linux     flock, which serialises builds of the real-vLLM venv
#
# Installing needs root and apt-get; without them, it names what is missing and stops.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
python="${PYTHON:-python3}"

command -v "$python" >/dev/null 2>&1 || {
  echo "system-deps: $python not found; the project needs Python 3.11 with venv (set PYTHON=)" >&2
  exit 1
}
missing=()
# `python3 -m venv --help` answers without ensurepip, yet creating a venv then fails: ask for ensurepip itself.
if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  missing+=("python$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing+=(prometheus)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v flock >/dev/null 2>&1 || missing+=(util-linux)
((${#missing[@]})) || exit 0

if [[ $(id -u) -ne 0 ]]; then
  echo "system-deps: missing Debian packages: ${missing[*]}" >&2
  echo "system-deps: install them with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing: ${missing[*]} (Debian package names), and there is no apt-get here to install them;" >&2
  echo "system-deps: install the equivalents with this system's package manager, then run make again" >&2
  exit 1
fi
echo "system-deps: installing ${missing[*]}" >&2
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
