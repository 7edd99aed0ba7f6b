#!/usr/bin/env bash
# Nsight Compute on the decode step's heaviest kernels (see benches/README.md): the seeded 2.0 B
# hybrid_kda of benches/device/kimi-2b.toml through `kvflow bench speed`, skipping the prefill
# launches, then each named kernel's speed-of-light, occupancy and memory figures. Through the
# device tool after `bash benches/device/prepare.sh`, carrying .device-bin:
#     bash benches/device/profile.sh ["expert_linear|paged_attention"]
# Raw output goes to $OUT/profile-run.txt (or ./profile-run.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}/profile-run.txt"
bin=.device-bin/kvflow
kernels=${1:-"expert_linear|paged_attention|linear_t1|linear_t2|kda_recurrent|sample_greedy"}
ckpt=${SPEED_CHECKPOINT:-/tmp/kimi-2b}
exec > >(tee "$out") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
[ -f "$ckpt/model.safetensors" ] || "$bin" seed-checkpoint benches/device/kimi-2b.toml "$ckpt" || exit 1
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# one prefill of 64 × 256 launches each kernel a few dozen times: skip 4 prefills' worth
"$ncu" -k "regex:^($kernels)\$" --launch-skip 400 --launch-count 12 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    "$bin" bench speed --model "$ckpt" --steps 2
