#!/usr/bin/env bash
# Simulation fidelity (issue 44), in one device call: writes the seeded dense 1 B Llama, measures
# its step table on the GPU (`kvflow bench calibrate`, bfloat16), replays 200 requests of the
# Mooncake head trace through one cuda rank (benches/device/sim-fidelity.toml), then simulates
# the same replay (executor "sim") from that table and prints TTFT, TPOT and throughput of both
# side by side with their ratio. Carry .device-bin (benches/device/prepare.sh):
#     bash benches/device/sim_fidelity.sh
# Raw output in $OUT (or /tmp/sim-fidelity): the run's text, the table, both reports.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benches/device/binaries.sh
bin=.device-bin/kvflow
out="${OUT:-/tmp/sim-fidelity}"
mkdir -p "$out"
exec > >(tee "$out/sim-fidelity-run.txt") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
dense=${SIM_DENSE_CHECKPOINT:-/tmp/llama-1b}
start=$(date +%s)
[ -f "$dense/model.safetensors" ] || timeout -k 5 150 "$bin" seed-checkpoint benches/device/llama-1b.toml "$dense" || exit 1
echo "== checkpoint ready [$(( $(date +%s) - start )) s]"
table="$out/llama-1b-bf16-table.json"
timeout -k 5 200 "$bin" bench calibrate --model "$dense" --dtype bfloat16 --out "$table" || exit 1
echo "== calibrated [$(( $(date +%s) - start )) s]"
graph() { # graph EXECUTOR SETTINGS OUT
    sed -e "s#MODEL#$dense#" -e "s#EXECUTOR#$1#" -e "s#SETTINGS#$2#" -e "s#TRACE#$PWD/traces/mooncake_conversation_head.jsonl#" \
        -e "s#OUT#$3#" benches/device/sim-fidelity.toml > "$3.toml"
    echo "$3.toml"
}
real=$(graph cuda 'dtype = "bfloat16"' "$out/real")
timeout -k 5 240 "$bin" run "$real" --stall-timeout 120 || echo "== the real run: exit status $?"
echo "== real run done [$(( $(date +%s) - start )) s]"
sim=$(graph sim "table = \"$table\"" "$out/sim")
timeout -k 5 120 "$bin" run "$sim" || echo "== the simulated run: exit status $?"
echo "== simulated run done [$(( $(date +%s) - start )) s]"
python3 - "$out/real/report.json" "$out/sim/report.json" <<'PY'
import json, sys
real, sim = (json.load(open(p)) for p in sys.argv[1:3])
rows = [("TTFT p50 ms", "ttft_ms", "p50"), ("TTFT p99 ms", "ttft_ms", "p99"), ("TPOT p50 ms", "tpot_ms", "p50"),
        ("TPOT p99 ms", "tpot_ms", "p99"), ("e2e p50 ms", "e2e_ms", "p50"), ("output tokens/s", "output_tokens_per_s", None),
        ("completed", "completed", None)]
print(f"{'figure':<18} {'real (cuda)':>12} {'simulated':>12} {'sim/real':>9}")
for label, key, q in rows:
    r, s = real.get(key), sim.get(key)
    if q is not None:
        r, s = (r or {}).get(q), (s or {}).get(q)
    ratio = f"{s / r:.3f}" if isinstance(r, (int, float)) and isinstance(s, (int, float)) and r else "-"
    print(f"{label:<18} {r if r is not None else '-':>12} {s if s is not None else '-':>12} {ratio:>9}")
PY
