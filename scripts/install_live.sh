#!/usr/bin/env bash
# The venv for `pdgate live`: SGLang 0.5.23 (its wheel from the conform cache), its
# non-GPU dependencies, sglang-router and the non-CUDA Mooncake wheel, on torch 2.13.0 CPU
# from local disk (never a bare torch: pip would take a CUDA build). Kept in
# $PDGATE_LIVE_VENV (default ~/.cache/pdgate/live-venv); a finished venv is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PDGATE_LIVE_VENV:-$HOME/.cache/pdgate/live-venv}"
[ -f "$VENV/.pdgate-live-ok" ] && { echo "pdgate live: venv ready in $VENV"; exit 0; }
WHEEL="$(python -c 'from impl.sglang.wheels import wheel_path; print(wheel_path("0.5.23"))')"
python -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.13.0
echo "torch==2.13.0" > "$VENV/constraints.txt"
# SGLang's requirements without the GPU-only ones and without torch's own family
# (torch pinned above; torchvision matched to it with --no-deps below)
python -m impl.sglang.live_deps "$WHEEL" > "$VENV/requirements.txt"
"${PIP[@]}" -c "$VENV/constraints.txt" -r "$VENV/requirements.txt" \
    sglang-router==0.3.2 mooncake-transfer-engine-non-cuda==0.3.13.post1
"${PIP[@]}" --no-deps torchvision==0.28.0 "$WHEEL"
# SGLang's schedulers are spawned with -B (no .pyc written): compile once here, or every
# start recompiles what they import
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
touch "$VENV/.pdgate-live-ok"
echo "pdgate live: venv ready in $VENV"
