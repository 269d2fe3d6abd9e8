#!/usr/bin/env bash
# Installs the Debian packages the tests need, only those missing; `make test` runs it first.
#
#   python3-venv   the project's venv and the real-vLLM venv
#   prometheus     promtool and the server, for the checks of deploy/prometheus
#   util-linux     flock, which serialises builds of the real-vLLM venv
#
# Installing needs root (apt-get); without it, it names what is missing and how to install it.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

missing=()
python3 -m venv --help >/dev/null 2>&1 || missing+=(python3-venv)
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing+=(prometheus)
command -v flock >/dev/null 2>&1 || missing+=(util-linux)
((${#missing[@]})) || exit 0

if [[ $(id -u) -ne 0 ]]; then
  echo "system-deps: missing Debian packages: ${missing[*]}" >&2
  echo "system-deps: install them with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "system-deps: installing ${missing[*]}" >&2
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
