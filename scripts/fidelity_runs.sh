#!/usr/bin/env bash
# The real `pdgate e2e` runs that `pdgate calibrate --validate` is measured against
# (docs/SIMULATOR.md, "Calibration"): each setup repeated with other seeds, one after
# another, gzipped JSON (trace and work-dir paths removed) into OUT (default
# bench/data/fidelity/quiet). Run it on a machine doing nothing else: every JSON records
# the load average and CPU pressure before and after its run (`machine_load`).
#   REQUESTS (default 500: T=4 at the default pages fits the 2 GiB KV limit) requests per run;
#   REPEATS (default 3) runs per setup, REPEATS + 2 for the calibration's own setup (T=2,
#   inflight 16), so that its repeats show the noise floor. Runs already in OUT are kept
#   (rerun to resume); the first run that does not commit cleanly stops the script, its
#   JSON and work folder kept and named.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/data/fidelity/quiet}"
REQUESTS="${REQUESTS:-500}"
REPEATS="${REPEATS:-3}"
mkdir -p "$OUT"

run() {   # NAME SEED FLAGS...
    local name="$1" seed="$2"; shift 2
    local json="$OUT/$name-s$seed.json"
    [ -f "$json.gz" ] && return 0
    local tmp; tmp="$(mktemp -d)"
    if ! pdgate e2e --requests "$REQUESTS" --seed "$seed" --json "$json" \
            --work-dir "$tmp" "$@" >/dev/null; then
        echo "fidelity: $name seed $seed did not commit cleanly (kept: $json and $tmp)" >&2
        return 1
    fi
    python - "$json" <<'EOF'
import json, sys
path = sys.argv[1]
run = json.load(open(path))
for key in ("trace", "work_dir"):
    run.pop(key, None)
json.dump(run, open(path, "w"))
EOF
    gzip -f "$json"
    rm -rf "$tmp"
    echo "fidelity: $name seed $seed done"
}

for seed in $(seq 1 $((REPEATS + 2))); do run r2 "$seed" --ranks 2; done
for seed in $(seq 1 "$REPEATS"); do
    run r4 "$seed" --ranks 4
    run r2-delay20 "$seed" --ranks 2 --metadata-delay 1:20
    run r2-delay10 "$seed" --ranks 2 --metadata-delay 1:10
    run r4-delay20 "$seed" --ranks 4 --metadata-delay 2:20
    run r2-inflight4 "$seed" --ranks 2 --inflight 4
    run r2-inflight32 "$seed" --ranks 2 --inflight 32
done
