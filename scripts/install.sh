#!/usr/bin/env bash
# Installs everything pdgate needs on a fresh Debian machine with Python 3.11.
# torch first, pinned, so pip takes the CPU build on local disk instead of a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
# util-linux: nsenter, for `pdgate e2e`'s private network namespace (impl/mooncake/netns.py);
# iproute2: `pdgate live`'s namespace loopback; patch: conform's diffs
$SUDO apt-get install -y -qq libibverbs1 libnuma1 libcurl4 iproute2 util-linux patch >/dev/null
python -m pip install -q --root-user-action=ignore torch==2.13.0
python -m pip install -q --root-user-action=ignore -e '.[test,mooncake-cpu]'
# setup.py compiles the simulator's hot modules with mypyc where a C compiler is there
python -c 'from model import _native; print("pdgate: the simulator is", "compiled" if _native.compiled() else "plain Python (compiled build skipped: see the install log)")'
# SGLang's released wheels, for `pdgate conform` (read from the cache, never fetched at run
# time): every release in impl/sglang/wheels.py's RELEASES (0.5.12 to 0.5.23, about 250 MB),
# without dependencies, into $PDGATE_SGLANG_CACHE (default ~/.cache/pdgate/sglang);
# releases already there are kept.
SGLANG_CACHE="${PDGATE_SGLANG_CACHE:-$HOME/.cache/pdgate/sglang}"
mkdir -p "$SGLANG_CACHE"
for v in $(python -c 'from impl.sglang.wheels import RELEASES; print(*RELEASES)'); do
    if ! ls "$SGLANG_CACHE"/sglang-"$v"-*.whl >/dev/null 2>&1; then
        python -m pip download -q --no-deps "sglang==$v" -d "$SGLANG_CACHE"
    fi
done
# `pdgate live`'s venv: SGLang 0.5.23 on CPU with sglang-router and Mooncake (a separate
# venv, ~/.cache/pdgate/live-venv by default; kept once built). It reads the cached wheel.
bash scripts/install_live.sh
