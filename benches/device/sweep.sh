#!/usr/bin/env bash
# Kernel variants side by side on the device machine (see benches/README.md): for each variant —
# a space-separated list of `--tune NAME=VALUE` settings, the first variant the defaults — it runs
# `kvflow bench kernels` (the tensor-core kernels' bits, seconds) and, where those pass,
# `kvflow bench speed` on the seeded dense 1 B in bf16 at the shapes, then prints one summary
# line per variant and shape. After `bash benches/device/prepare.sh` here, through the device
# tool, carrying .device-bin:
#     bash benches/device/sweep.sh "" "BF16_STAGES=3" "FA_X1_STAGES=3 SPLIT_CHUNKS=2" ...
# With no variant named it runs the defaults and then most constants one step away from their
# defaults (about a minute a variant on the H200: the NVRTC compile, the checks, three shapes).
# A setting `at=COMMIT` runs that variant on the build of an earlier commit, put beside the
# current one by `bash benches/device/prepare.sh --also COMMIT` (.device-bin/kvflow-COMMIT): the
# figures of a change and of what it replaced from the same call.
# SWEEP_SHAPES (default 64x256,1x256,16x4096), SWEEP_STEPS (default 8), SWEEP_BUDGET_S (default
# 540: a variant that would start past it is skipped, saying so). Raw output goes to
# $OUT/sweep-run.txt (or ./sweep-run.txt). A rehearsal without a GPU (the script's own logic):
# SWEEP_REHEARSAL=1 with a tiny checkpoint at SWEEP_CHECKPOINT and tiny SWEEP_SHAPES (emulated).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}/sweep-run.txt"
source benches/device/binaries.sh
bin=.device-bin/kvflow
if [ ! -x "$bin" ]; then echo "no $bin: run benches/device/prepare.sh first and carry .device-bin" >&2; exit 2; fi
[ "$#" -gt 0 ] || set -- "" "PDL=1" "SPLIT_UNDER=1" "BF16_STAGES=3" "SPLIT_UNDER=1 BF16_STAGES=3" "SPLIT_SUM_LAUNCH=0" \
    "FA_X1_STAGES=3" "FA_STAGES=3"
shapes=${SWEEP_SHAPES:-64x256,1x256,16x4096} steps=${SWEEP_STEPS:-8} budget=${SWEEP_BUDGET_S:-540}
ckpt=${SWEEP_CHECKPOINT:-/tmp/llama-1b}
emulate=()
[ "${SWEEP_REHEARSAL:-0}" = 1 ] && emulate=(--emulate)
exec > >(tee "$out") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
start=$(date +%s)
[ -f "$ckpt/model.safetensors" ] || "$bin" seed-checkpoint benches/device/llama-1b.toml "$ckpt" || exit 1
status=0 summary=()
for variant in "$@"; do
    elapsed=$(( $(date +%s) - start ))
    name=${variant:-defaults}
    if [ "$elapsed" -ge "$budget" ]; then echo "== $name: skipped, $elapsed s of $budget s gone"; status=1; continue; fi
    tune=() run=$bin
    for setting in $variant; do
        case "$setting" in
            at=*) run=.device-bin/kvflow-${setting#at=} ;;
            *) tune+=(--tune "$setting") ;;
        esac
    done
    if [ ! -x "$run" ]; then
        echo "== $name: no $run (bash benches/device/prepare.sh --also COMMIT builds it)"; status=1; summary+=("$name: no $run"); continue
    fi
    echo "== $name [$elapsed s]"
    "$run" bench kernels "${tune[@]}" "${emulate[@]}"
    rc=$?
    if [ "$rc" != 0 ]; then
        # (what failed is printed above: a check, or a setting refused by name, such as a tuning
        # constant an earlier build does not have)
        echo "== $name: bench kernels exit status $rc, not timed"; status=1; summary+=("$name: bench kernels exit status $rc"); continue
    fi
    "$run" bench speed --model "$ckpt" --dtype bfloat16 --shapes "$shapes" --steps "$steps" "${tune[@]}" "${emulate[@]}" > /tmp/sweep-speed.txt 2>&1
    rc=$?
    cat /tmp/sweep-speed.txt
    [ "$rc" = 0 ] || { status=1; summary+=("$name: bench speed exit status $rc"); continue; }
    while read -r line; do summary+=("$name | ${line#summary      }"); done < <(grep '^summary ' /tmp/sweep-speed.txt)
done
echo "== summary (decode ms/step and prefill tokens/s per variant and shape)"
for line in "${summary[@]}"; do echo "$line"; done
echo "== done in $(( $(date +%s) - start )) s, status $status"
exit $status
