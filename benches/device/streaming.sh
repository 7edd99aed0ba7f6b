#!/usr/bin/env bash
# Streamed against whole handoffs on the GPU (issue 42 §1): benches/streaming.sh with both pools
# on `executor = "cuda"` in bf16 and the seeded dense 1.0 B Llama of benches/device/llama-1b.toml,
# over tcp on loopback, after 2 warmup requests (and a 5 s pause):
#   - 4,096-token prompts 500 ms apart (the prefill rank keeps up) at 10 Gbit/s; then the
#     streamed graph again with test switch `pieces-at-completion` (chunk by chunk, as a CPU rank
#     streams: against layer by layer) and with `unmarked-pieces` (the link reads layers without
#     waiting for the forward to write them: `--verify` must count mismatches);
#   - 256-token prompts 100 ms apart in chunks of 64, every prompt streamed, at 10 Gbit/s;
#   - with `BUSY=1`, 4,096-token prompts 150 ms apart (faster than the prefill rank serves
#     them), no link rate.
# `QUICK=1` leaves out the chunk-by-chunk variant; `FIRST=1` stops after the first case and its
# unmarked variant. Then, with `CPU=1`, the CPU acceptance case on this machine's cores (8 prompts of 4,096 tokens,
# 1,800 ms apart, 100 MB/s). Carry .device-bin (benches/device/prepare.sh). Raw output goes to
# $OUT/streaming-run.txt (or ./streaming-run.txt), each run's requests.jsonl beside it.
#     bash benches/device/streaming.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source benches/device/binaries.sh
out="${OUT:-.}"
exec > >(tee "$out/streaming-run.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
export BIN=${BIN:-.device-bin/kvflow} WARMUP=${WARMUP:-2}
status=0
run() {  # run NAME ARGS… (benches/streaming.sh's), its requests kept as $out/NAME-*.jsonl
    local name=$1
    shift
    WORK=/tmp/streaming-$name bash benches/streaming.sh "$@" || status=1
    for v in whole streamed; do cp "/tmp/streaming-$name/out/$v/requests.jsonl" "$out/$name-$v.jsonl" 2>/dev/null; done
}
gpu() { SPEC=benches/device/llama-1b.toml EXECUTOR=cuda DTYPE=bfloat16 BUDGET="16 GiB" run "$@"; }
variant() {  # variant CASE SWITCH: CASE's streamed graph again with --test-switch SWITCH
    local work=/tmp/streaming-$1
    echo "$1 streamed with --test-switch $2:"
    "$BIN" run "$work/streamed.toml" --verify --test-switch "$2" --out "$work/$2" >"$work/$2.log" 2>&1
    echo "exit status $?"
    python3 - "$work/$2/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
h = r["handoff"]
print(f"  transfer after T0 p50 {r['ttft_split_ms']['transfer']['p50']:.1f} ms | TTFT p50 {r['ttft_ms']['p50']:.1f} ms | "
      f"2nd token p50 {r['second_token_ms']['p50']:.1f} ms | pieces {h['pieces']} (at launch {h['pieces_at_launch']}), "
      f"streamed {h['streamed_bytes'] / 1e6:.1f} MB | verify {r['verify']['mismatched']}/{r['verify']['checked']} mismatched")
PY
}
gpu gpu-4096-500 4096 16 500 "10 Gbit/s" 1024
variant gpu-4096-500 unmarked-pieces
[ "${FIRST:-0}" = 1 ] && exit $status
[ "${QUICK:-0}" = 1 ] || variant gpu-4096-500 pieces-at-completion
CHUNK=64 gpu gpu-256 256 16 100 "10 Gbit/s" 1
[ "${BUSY:-0}" = 1 ] && gpu gpu-4096-150 4096 16 150 none 1024
[ "${CPU:-0}" = 1 ] && WARMUP=0 run cpu-4096 4096 8 1800 "100 MB/s" 1024
exit $status
