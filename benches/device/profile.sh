#!/usr/bin/env bash
# Nsight Compute on the decode step's heaviest kernels (see benches/README.md): a seeded model
# through `kvflow bench speed` in bf16 at batch 64, prompts of 256 (PROFILE_SPEC: the dense 1 B of
# benches/device/llama-1b.toml by default; benches/device/kimi-2b.toml for the hybrid), skipping
# the prefill launches, then each named kernel's speed-of-light, occupancy and memory figures.
# Through the device tool after `bash benches/device/prepare.sh`, carrying .device-bin:
#     bash benches/device/profile.sh ["linear_bf16_split|flash_attention_64x1"]
# Raw output goes to $OUT/profile-run.txt (or ./profile-run.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}/profile-run.txt"
source benches/device/binaries.sh
bin=.device-bin/kvflow
kernels=${1:-"linear_bf16_split|linear_bf16|flash_attention_64x1|flash_attention_64|flash_attention_merge|rope_pair|rms_norm|swiglu|expert_linear_bf16|paged_attention|kda_recurrent|sample_greedy"}
spec=${PROFILE_SPEC:-benches/device/llama-1b.toml}
ckpt=${PROFILE_CHECKPOINT:-/tmp/$(basename "$spec" .toml)}
exec > >(tee "$out") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
[ -f "$ckpt/model.safetensors" ] || "$bin" seed-checkpoint "$spec" "$ckpt" || exit 1
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# one prefill of 64 × 256 launches each kernel a few dozen times: skip 4 prefills' worth
"$ncu" -k "regex:^($kernels)\$" --launch-skip 400 --launch-count 12 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
    "$bin" bench speed --model "$ckpt" --dtype bfloat16 --shapes 64x256 --steps 2
