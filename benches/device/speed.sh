#!/usr/bin/env bash
# kvflow's CUDA executor against transformers and torch on the same GPU, weights and dtype, in
# one device call of at most 600 s (see benches/README.md): `bash benches/device/prepare.sh` here,
# then through the device tool, carrying .device-bin:
#     bash benches/device/speed.sh
# Writes the seeded dense 1.0 B Llama of benches/device/llama-1b.toml and the seeded 2.0 B
# hybrid_kda of benches/device/kimi-2b.toml as checkpoints (in parallel), times the anchors on
# each (benches/device/transformers_speed.py: eager, the weight products alone, static cache +
# compiled decode step, SDPA prefill; for the KDA model also the flash-linear-attention kernels,
# installed from .device-bin/wheels into a folder under /tmp put on PYTHONPATH for that run only),
# then `kvflow bench speed` beside those figures at each shape (dense: 64x256 in float32 and
# bfloat16, then 1x256, 16x4096 and 1x32768 in bfloat16; kimi: 64x256), each shape with its
# kernel profile, and last, when time is left, the P/D graph against the aggregated one on this GPU
# (kvflow compare). Each part has a budget of seconds and none runs past SPEED_BUDGET_S (550) in
# all; the elapsed seconds are printed before each part.
# SPEED_MODELS picks the models (default "dense kimi"); on the H200 the two do not fit one call's
# 600 s with every anchor (the dense part took 300 s on 2026-12-05, the KDA model's compiled
# decode and flash-linear-attention kernels need about 350 s more), so run them as two calls:
# SPEED_MODELS=dense, then SPEED_MODELS=kimi — each ratio still has its baseline from its own call.
# Skip parts with SPEED_SKIP_LONG=1 (16x4096 and 1x32768), SPEED_SKIP_32K=1, SPEED_SKIP_COMPILED=1
# (transformers' compiled decode), SPEED_SKIP_KIMI=1, SPEED_SKIP_FLA=1, SPEED_SKIP_COMPARE=1;
# SPEED_NCU=1 adds benches/device/profile.sh (Nsight Compute) on the dense model when time is left.
# A rehearsal without a GPU (the script's own logic): SPEED_REHEARSAL=1 runs torch on the cpu and
# kvflow's kernels emulated, with tiny checkpoints already written at SPEED_DENSE_CHECKPOINT and
# SPEED_CHECKPOINT and tiny shapes in SPEED_SHAPE, SPEED_BATCH1, SPEED_LONG, SPEED_32K.
# Raw output goes to $OUT/speed-run.txt (or ./speed-run.txt), the anchors' JSON beside it.
set -uo pipefail
cd "$(dirname "$0")/../.."
outdir="${OUT:-.}"
out="$outdir/speed-run.txt"
source benches/device/binaries.sh
bin=.device-bin/kvflow
if [ ! -x "$bin" ]; then echo "no $bin: run benches/device/prepare.sh first and carry .device-bin" >&2; exit 2; fi
dense=${SPEED_DENSE_CHECKPOINT:-/tmp/llama-1b}
kimi=${SPEED_CHECKPOINT:-/tmp/kimi-2b}
total=${SPEED_BUDGET_S:-550}
steps=${SPEED_STEPS:-16}
shape=${SPEED_SHAPE:-64x256} batch1=${SPEED_BATCH1:-1x256} long=${SPEED_LONG:-16x4096} s32k=${SPEED_32K:-1x32768}
rehearsal=() torch_device=cuda
[ "${SPEED_REHEARSAL:-0}" = 1 ] && rehearsal=(--emulate) torch_device=cpu
skip() { [ "${!1:-0}" = 1 ]; }
models=" ${SPEED_MODELS:-dense kimi} "
for m in $models; do
    case "$m" in dense|kimi) ;; *) echo "SPEED_MODELS: unknown model '$m' (expected dense, kimi or both)" >&2; exit 2 ;; esac
done
# wanted MODEL: whether SPEED_MODELS names it
wanted() { case "$models" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
wanted kimi || SPEED_SKIP_KIMI=1
exec > >(tee "$out") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
status=0
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

# begin NAME BUDGET_S [SKIP_VARIABLE]: prints the part's header with the elapsed seconds and sets
# $cap, the seconds it may take (its budget, never past the total); fails when the part is to be
# skipped (asked, or under 10 s left), saying so.
begin() {
    local name=$1 budget=$2 left=$(( total - $(elapsed) ))
    if [ -n "${3:-}" ] && skip "$3"; then echo "== $name: skipped ($3=1) [$(elapsed) s]"; return 1; fi
    if [ "$left" -lt 10 ]; then echo "== $name: skipped, $left s of the $total s left [$(elapsed) s]"; status=1; return 1; fi
    cap=$(( budget < left ? budget : left ))
    deadline=$(( cap > 20 ? cap - 10 : cap - 2 ))  # transformers_speed.py's own, inside the cap
    echo "== $name (at most $cap s) [$(elapsed) s]"
}
# ended NAME RC: says how a part ended when it did not end well.
ended() {
    case "$2" in
        0) ;;
        124|137) echo "== $1: cut at its $cap s [$(elapsed) s]"; status=1 ;;
        *) echo "== $1: exit status $2 [$(elapsed) s]"; status=1 ;;
    esac
}

# the two checkpoints, written side by side
if begin "kvflow seed-checkpoint ($(echo $models))" 150; then
    pids=() pairs=()
    wanted dense && pairs+=("benches/device/llama-1b.toml:$dense")
    wanted kimi && pairs+=("benches/device/kimi-2b.toml:$kimi")
    for pair in "${pairs[@]}"; do
        spec=${pair%%:*} dir=${pair#*:}
        [ -f "$dir/model.safetensors" ] || { timeout -k 5 "$cap" "$bin" seed-checkpoint "$spec" "$dir" & pids+=($!); }
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    ended "seed-checkpoint" "$rc"
fi
for m in $models; do
    dir=$dense
    [ "$m" = kimi ] && dir=$kimi
    [ -f "$dir/model.safetensors" ] || { echo "no $dir/model.safetensors: nothing to measure"; exit 1; }
done

dense_shapes="$shape,$batch1"
skip SPEED_SKIP_LONG || dense_shapes="$dense_shapes,$long"
skip SPEED_SKIP_LONG || skip SPEED_SKIP_32K || dense_shapes="$dense_shapes,$s32k"
compiled=()
skip SPEED_SKIP_COMPILED && compiled=(--no-compiled)
dense_json=/tmp/speed-llama-1b.json kimi_json=/tmp/speed-kimi-2b.json
rm -f "$dense_json" "$kimi_json"

# speed DTYPE SHAPES CHECKPOINT BASELINE...: kvflow bench speed at those shapes
speed() {
    local dtype=$1 shapes=$2 ckpt=$3
    shift 3
    timeout -k 5 "$cap" "$bin" bench speed --model "$ckpt" --dtype "$dtype" --shapes "$shapes" --steps "$steps" "${rehearsal[@]}" "$@"
    ended "kvflow bench speed" $?
}

if wanted dense; then
if begin "transformers on llama-1b at $dense_shapes (benches/device/transformers_speed.py)" 190 SPEED_SKIP_TRANSFORMERS; then
    timeout -k 5 "$cap" python3 benches/device/transformers_speed.py "$dense" "$dense_json" --shapes "$dense_shapes" \
        --float32-shapes "$shape" --steps "$steps" --deadline-s "$deadline" --device "$torch_device" "${compiled[@]}"
    ended transformers $?
fi
dense_baseline=()
[ -f "$dense_json" ] && dense_baseline=(--baseline "$dense_json") && cp "$dense_json" "$outdir/"
if begin "kvflow bench speed llama-1b $shape (float32, bfloat16)" 70; then
    speed both "$shape" "$dense" "${dense_baseline[@]}"
fi
more="$batch1"
skip SPEED_SKIP_LONG || more="$batch1,$long"
if begin "kvflow bench speed llama-1b $more (bfloat16)" 80; then
    speed bfloat16 "$more" "$dense" "${dense_baseline[@]}"
fi
fi

if ! skip SPEED_SKIP_KIMI; then
    if begin "transformers on kimi-2b at $shape (benches/device/transformers_speed.py)" 140 SPEED_SKIP_TRANSFORMERS; then
        timeout -k 5 "$cap" python3 benches/device/transformers_speed.py "$kimi" "$kimi_json" --shapes "$shape" \
            --float32-shapes "$shape" --steps "$steps" --deadline-s "$deadline" --device "$torch_device" "${compiled[@]}"
        ended transformers $?
    fi
    if [ -f "$kimi_json" ] && begin "transformers on kimi-2b with the flash-linear-attention 0.6.0 kernels" 240 SPEED_SKIP_FLA; then
        site=/tmp/fla-site
        rm -rf "$site"
        if python3 -m pip install --quiet --no-index --no-deps --find-links .device-bin/wheels --target "$site" \
            fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2; then
            PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout -k 5 "$cap" python3 benches/device/transformers_speed.py \
                "$kimi" "$kimi_json" --fla --shapes "$shape" --steps "$steps" --deadline-s "$deadline" --device "$torch_device"
            ended "transformers with fla" $?
        else
            echo "== the wheels in .device-bin/wheels did not install (run benches/device/prepare.sh here)"; status=1
        fi
    fi
    kimi_baseline=()
    [ -f "$kimi_json" ] && kimi_baseline=(--baseline "$kimi_json") && cp "$kimi_json" "$outdir/"
    if begin "kvflow bench speed kimi-2b $shape (float32, bfloat16)" 60; then
        speed both "$shape" "$kimi" "${kimi_baseline[@]}"
    fi
fi

if wanted dense && ! skip SPEED_SKIP_LONG && begin "kvflow bench speed llama-1b $s32k (bfloat16)" 70 SPEED_SKIP_32K; then
    speed bfloat16 "$s32k" "$dense" "${dense_baseline[@]}"
fi

# P/D against aggregated on the one GPU (both graphs with executor = "cuda", the same trace, seed
# and 40 requests), side by side through kvflow compare
if wanted dense && begin "kvflow compare cuda-aggregated pd-1p1d (executor = cuda, both on this GPU) --limit 40 --verify" 45 SPEED_SKIP_COMPARE; then
    for graph in cuda-aggregated pd-1p1d; do
        sed -e 's/^executor = "cpu"/executor = "cuda"/' -e "s#out/$graph#out/compare-$graph#" "graphs/$graph.toml" > "graphs/.compare-$graph.toml"
    done
    timeout -k 5 "$cap" "$bin" compare graphs/.compare-cuda-aggregated.toml graphs/.compare-pd-1p1d.toml --limit 40 --verify > /tmp/compare.txt 2>&1
    rc=$?
    tail -n 30 /tmp/compare.txt
    ended compare "$rc"
    rm -f graphs/.compare-cuda-aggregated.toml graphs/.compare-pd-1p1d.toml
fi

if wanted dense && [ "${SPEED_NCU:-0}" = 1 ] && begin "Nsight Compute on the dense decode step (benches/device/profile.sh)" 120; then
    PROFILE_CHECKPOINT="$dense" timeout -k 5 "$cap" bash benches/device/profile.sh
    ended profile.sh $?
fi
echo "== done in $(elapsed) s, status $status"
exit $status
