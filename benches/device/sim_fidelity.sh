#!/usr/bin/env bash
# Simulation fidelity (issue 44), in one device call, for each model named (the seeded specs
# benches/device/NAME.toml; default llama-1b): writes the checkpoint, measures its step table on
# the GPU (`kvflow bench calibrate`, bfloat16: device, launch and engine times), replays 200
# requests of the Mooncake conversation trace through one cuda rank (its first 203 rows that fit
# the model's context with 128 output tokens: the head trace for llama-1b; shorter ones for
# kimi-2b, whose context is 8,192; benches/device/sim-fidelity.toml,
# every step logged), then simulates the same replay (executor "sim") from that table and prints
# TTFT, TPOT and throughput of both side by side with their ratio, then the steps' times by kind
# (real against simulated: what the cost model misprices). Carry .device-bin (prepare.sh):
#     bash benches/device/sim_fidelity.sh [llama-1b] [kimi-2b]
# Raw output in $OUT (or /tmp/sim-fidelity): the run's text, and per model the table, both
# reports and both step logs, packed as NAME-runs.tar.xz (the folder removed once packed: the
# device tool brings back only so many files a call).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benches/device/binaries.sh
bin=.device-bin/kvflow
out="${OUT:-/tmp/sim-fidelity}"
# The offload graph's KV memory per rank and chunk size (OFFLOAD=0: no offload graph).
OFFLOAD_BUDGET="${OFFLOAD_BUDGET:-4 GiB}"
OFFLOAD_CHUNK="${OFFLOAD_CHUNK:-256}"
mkdir -p "$out"
exec > >(tee "$out/sim-fidelity-run.txt") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
fidelity() { # fidelity NAME: one model's calibration, real run, simulated run and comparison
    local name=$1 ckpt=/tmp/$1 dir="$out/$1"
    mkdir -p "$dir"
    [ -f "$ckpt/model.safetensors" ] || timeout -k 5 150 "$bin" seed-checkpoint "benches/device/$name.toml" "$ckpt" || return 1
    echo "== $name: checkpoint ready [$(( $(date +%s) - start )) s]"
    local table="$dir/table.json" trace="$dir/trace.jsonl"
    python3 -c 'import json, sys
config = json.load(open(sys.argv[1] + "/config.json"))
fits = config.get("max_position_embeddings", 1 << 30) - 128
rows = [line for line in open("traces/mooncake_conversation.jsonl") if json.loads(line)["input_length"] <= fits]
open(sys.argv[2], "w").writelines(rows[:203])
print("== the trace: the first %d rows of the Mooncake conversation trace with at most %d prompt tokens" % (min(203, len(rows)), fits))' \
        "$ckpt" "$trace" || return 1
    # (CALIBRATE_FLAGS: a coarser grid, e.g. "--prefix 0,4096 --context 256,4096 --steps 16", for a short call)
    # shellcheck disable=SC2086
    timeout -k 5 "${CALIBRATE_TIMEOUT:-400}" "$bin" bench calibrate --model "$ckpt" --dtype bfloat16 --out "$table" \
        ${CALIBRATE_FLAGS:-} || return 1
    echo "== $name: calibrated [$(( $(date +%s) - start )) s]"
    graph() { # graph EXECUTOR SETTINGS OUT [OFFLOAD_STORE]: with a store, the offload graph
        sed -e "s#MODEL#$ckpt#" -e "s#EXECUTOR#$1#" -e "s#SETTINGS#$2#" \
            -e "s#TRACE#$trace#" -e "s#OUT#$3#" benches/device/sim-fidelity.toml > "$3.toml"
        if [ -n "${4:-}" ]; then
            # Little KV memory (prefixes leave it while the store keeps them), the store in host memory.
            sed -i -e "s#^budget_bytes = .*#budget_bytes = \"$OFFLOAD_BUDGET\"#" "$3.toml"
            printf '\n[offload]\n%s\ncapacity_bytes = "64 GiB"\nchunk_tokens = %s\n' "$4" "$OFFLOAD_CHUNK" >> "$3.toml"
        fi
        echo "$3.toml"
    }
    timeout -k 5 240 "$bin" run "$(graph cuda 'dtype = "bfloat16"' "$dir/real")" --stall-timeout 120 || echo "== the real run: exit status $?"
    echo "== $name: real run done [$(( $(date +%s) - start )) s]"
    timeout -k 5 120 "$bin" run "$(graph sim "table = \"$table\"" "$dir/sim")" || echo "== the simulated run: exit status $?"
    echo "== $name: simulated run done [$(( $(date +%s) - start )) s]"
    python3 benches/device/sim_fidelity_compare.py "$dir/real" "$dir/sim"
    [ "${OFFLOAD:-1}" = 1 ] || return 0
    # The offload graph: the real run's store is in host memory; the simulated one moves its
    # chunks at the save and load rates calibrate measured for that store (the table's `store`).
    timeout -k 5 240 "$bin" run "$(graph cuda 'dtype = "bfloat16"' "$dir/real-offload" 'store = "memory"')" --stall-timeout 120 \
        || echo "== the real offload run: exit status $?"
    echo "== $name: real offload run done [$(( $(date +%s) - start )) s]"
    local rates
    rates=$(python3 -c 'import json, sys
s = json.load(open(sys.argv[1]))["store"]
print("store = \"sim\"\nsave_gbps = %.4f\nload_gbps = %.4f\nlatency_us = 0.0" % (s["save_bytes_per_s"] / 1e9, s["load_bytes_per_s"] / 1e9))' \
        "$table") || { echo "== $name: the table holds no store rates"; return 1; }
    echo "== $name: the store's rates, from the calibration: $(echo "$rates" | tr '\n' ' ')"
    python3 -c 'import json, sys
o = json.load(open(sys.argv[1])).get("offload") or {}
print("== (the real offload run measured: save %s GB/s, load %s GB/s)" % (o.get("save_gb_per_s"), o.get("load_gb_per_s")))' \
        "$dir/real-offload/report.json" || true
    timeout -k 5 120 "$bin" run "$(graph sim "table = \"$table\"" "$dir/sim-offload" "$rates")" \
        || echo "== the simulated offload run: exit status $?"
    echo "== $name: simulated offload run done [$(( $(date +%s) - start )) s]"
    python3 benches/device/sim_fidelity_compare.py "$dir/real-offload" "$dir/sim-offload"
}
for name in "${@:-llama-1b}"; do
    fidelity "$name" || echo "== $name: stopped"
    # (packed, the folder goes: the device tool brings back only so many files a call)
    tar -cJf "$out/$name-runs.tar.xz" -C "$out" "$name" && rm -rf "${out:?}/$name" \
        && echo "== $name: packed $out/$name-runs.tar.xz"
done
