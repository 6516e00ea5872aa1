#!/usr/bin/env bash
# pdgate e2e with the decode ranks' KV pages and metadata buffers in CUDA memory.
# For a machine with an NVIDIA GPU and driver. Needs the CUDA Mooncake wheel
# (pyproject extra `mooncake-cuda`; it replaces mooncake-transfer-engine-non-cuda,
# both ship the `mooncake` package). Writes figures and traces under $OUT.
#   scripts/gpu_e2e.sh            # RANKS=2 REQUESTS=64 by default
#   RANKS=4 REQUESTS=256 OUT=/tmp/gpu scripts/gpu_e2e.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${RANKS:-2}
REQUESTS=${REQUESTS:-64}
OUT=${OUT:-/tmp/pdgate-gpu-e2e}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
export MC_TRANSFER_TIMEOUT=${MC_TRANSFER_TIMEOUT:-10}

python - <<'PY' || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_e2e: torch sees no CUDA device (need a GPU, its driver and a CUDA build of torch)")
try:
    from mooncake.engine import TransferEngine  # noqa: F401
except ImportError as exc:
    sys.exit(f"gpu_e2e: mooncake not importable ({exc}); pip install -e '.[mooncake-cuda]'")
from importlib.metadata import PackageNotFoundError, version
try:
    version("mooncake-transfer-engine")
except PackageNotFoundError:
    sys.exit("gpu_e2e: the non-CUDA Mooncake wheel is installed; run: pip uninstall -y "
             "mooncake-transfer-engine-non-cuda && pip install -e '.[mooncake-cuda]'")
print(f"gpu_e2e: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PY

mkdir -p "$OUT"
run() {  # name, then pdgate e2e flags
    local name=$1; shift
    echo "== $name"
    timeout 900 python -m model.cli e2e --device cuda --ranks "$RANKS" "$@" \
        --json "$OUT/$name.json" --trace "$OUT/$name.ndjson"
    python -m model.cli validate "$OUT/$name.ndjson"
}
run cuda_strict --requests "$REQUESTS" --baseline
run cuda_gate --requests "$REQUESTS" --variant gate
run cuda_strict_delay --requests "$((REQUESTS / 2))" --metadata-delay "$((RANKS - 1)):20"
echo "figures and traces in $OUT"
