#!/usr/bin/env bash
# Installs everything pdgate needs on a fresh Debian machine with Python 3.11.
# torch first, pinned, so pip takes the CPU build on local disk instead of a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq libibverbs1 libnuma1 libcurl4 >/dev/null
python -m pip install -q --root-user-action=ignore torch==2.13.0
python -m pip install -q --root-user-action=ignore -e '.[test,mooncake-cpu]'
