#!/usr/bin/env bash
# Streamed against whole handoffs on the GPU (issue 42 §1): benches/streaming.sh with both pools
# on `executor = "cuda"` in bf16 and the seeded dense 1.0 B Llama of benches/device/llama-1b.toml,
# 4,096-token prompts arriving faster than the prefill rank serves them, over tcp on loopback —
# once without a link rate, once at 10 Gbit/s. Carry .device-bin (benches/device/prepare.sh).
# Raw output goes to $OUT/streaming-run.txt (or ./streaming-run.txt).
#     bash benches/device/streaming.sh [REQUESTS=16] [GAP_MS=150]
set -uo pipefail
cd "$(dirname "$0")/../.."
source benches/device/binaries.sh
out="${OUT:-.}/streaming-run.txt"
exec > >(tee "$out") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
requests=${1:-16} gap=${2:-150}
export BIN=.device-bin/kvflow SPEC=benches/device/llama-1b.toml EXECUTOR=cuda DTYPE=bfloat16 BUDGET="16 GiB" WORK=/tmp/streaming-gpu
status=0
for rate in none "10 Gbit/s"; do
    bash benches/streaming.sh 4096 "$requests" "$gap" "$rate" 1024 || status=1
done
exit $status
