#!/usr/bin/env bash
# Streamed handoffs against whole ones (issue 42 §1): prompts arriving faster than one prefill rank
# serves them, handed off over tcp on loopback at a link rate (graphs/pd-1p1d-tcp.toml's pools and
# link, `bandwidth` set) to one decode rank — once with every handoff whole after its prefill, once
# with `stream_min_tokens` set, so each completed chunk's blocks leave while the next computes. One
# `kvflow compare` of the two graphs (same trace, seed and --verify), then the ratio of the TTFT
# split's transfer (what was left after T0) and of TTFT, p50, streamed over whole.
#     bash benches/streaming.sh [PROMPT_TOKENS=4096] [REQUESTS=8] [GAP_MS=1800] [RATE="100 MB/s"|none] [STREAM_MIN=1024]
# Needs a release build; writes under target/streaming-<tokens>/ (or $WORK). The model is the
# seeded Llama-shaped benches/specs/mha_small.toml (4 layers, hidden 512; not a fixture), written
# there once. On the GPU (benches/device/streaming.sh): BIN=.device-bin/kvflow, SPEC (a seeded
# spec), EXECUTOR=cuda and DTYPE (both pools), BUDGET (each rank's memory); CHUNK: the prefill
# chunk (default 512 tokens); WARMUP: requests before the measured ones, then a 5 s pause (default 0;
# on the GPU the first requests pay for the kernels' first launches); COMMIT names the binary's commit when it is not .device-bin/COMMIT's.
set -euo pipefail
cd "$(dirname "$0")/.."
tokens=${1:-4096} requests=${2:-8} gap=${3:-1800} rate=${4:-100 MB/s} stream_min=${5:-1024}
bin=${BIN:-./target/release/kvflow} spec=${SPEC:-benches/specs/mha_small.toml}
executor=${EXECUTOR:-cpu} dtype=${DTYPE:-float32} budget=${BUDGET:-1 GiB} chunk=${CHUNK:-512} warmup=${WARMUP:-0}
[ -x "$bin" ] || { echo "no $bin: cargo build --release first" >&2; exit 2; }
work=${WORK:-target/streaming-$tokens}
mkdir -p "$work"
[ -f "$work/model/model.safetensors" ] || "$bin" seed-checkpoint "$spec" "$work/model" >/dev/null
settings=""
[ "$executor" = cuda ] && settings="\n[pool.executor_settings]\ndtype = \"$dtype\""
bandwidth="\nbandwidth = \"$rate\""
[ "$rate" = none ] && bandwidth=""
python3 benches/long_prompts.py "$work/trace.jsonl" "$tokens" "$((requests + warmup))" "$gap" "$warmup"
case "$work" in /*) root="" ;; *) root="$(pwd)/" ;; esac
graph() {  # graph NAME EXTRA_LINK_KEYS
    sed -e "s#^path = .*#path = \"$root$work/model\"#" \
        -e "s#^budget_bytes = .*#budget_bytes = \"$budget\"#" \
        -e "s#^executor = .*#executor = \"$executor\"$settings#" \
        -e "s#^max_batched_tokens = .*#max_batched_tokens = 512#" \
        -e "s#^chunk_tokens = .*#chunk_tokens = $chunk#" \
        -e "s#^trace = .*#trace = \"$root$work/trace.jsonl\"#" \
        -e "s#^time_scale = .*#time_scale = 1.0#" \
        -e "s#^warmup = .*#warmup = $warmup#" \
        -e "s#^limit = .*#limit = $requests#" \
        -e "s#^max_output_tokens = .*#max_output_tokens = 8#" \
        -e "s#^block_tokens = .*#block_tokens = 512#" \
        -e "s#^endpoint = .*#endpoint = \"127.0.0.1:0\"$bandwidth$2#" \
        graphs/pd-1p1d-tcp.toml > "$work/$1.toml"
}
graph whole ""
graph streamed "\nstream_min_tokens = $stream_min"
case "$bin" in .device-bin/*) built=$(cat .device-bin/COMMIT 2>/dev/null) ;; *) built="" ;; esac
commit=${COMMIT:-${built:-$(git rev-parse --short HEAD)}}
echo "streamed vs whole handoffs: $requests prompts (after $warmup warmup) of $tokens tokens, $gap ms apart, 1P1D over tcp on loopback at $rate, stream_min_tokens = $stream_min, chunks of $chunk, model $spec, executor $executor ($dtype), commit $commit, $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ)"
"$bin" compare "$work/whole.toml" "$work/streamed.toml" --verify --out "$work/out" 2>"$work/compare.log" ||
    { echo "the comparison failed (see $work/compare.log)"; tail -5 "$work/compare.log"; exit 1; }
python3 - "$work/out/whole/report.json" "$work/out/streamed/report.json" <<'PY'
import json, sys
whole, streamed = (json.load(open(p)) for p in sys.argv[1:])
for name, r in (("whole", whole), ("streamed", streamed)):
    h = r["handoff"]
    print(f"{name:<9} transfer after T0 p50 {r['ttft_split_ms']['transfer']['p50']:8.1f} ms | overlapped p50 "
          f"{r['transfer_overlapped_ms']['p50']:8.1f} ms | TTFT p50 {r['ttft_ms']['p50']:8.1f} ms p99 {r['ttft_ms']['p99']:8.1f} ms | "
          f"2nd token p50 {r['second_token_ms']['p50']:8.1f} ms | prefill p50 {r['ttft_split_ms']['prefill']['p50']:7.1f} ms | "
          f"{h['bytes'] / max(h['count'], 1) / 1e6:.1f} MB a handoff, {h['pieces']} pieces | completed {r['completed']}/{r['requests']}, "
          f"verify {r['verify']['mismatched']}/{r['verify']['checked']} mismatched")
ratio = lambda f: f(streamed) / f(whole)
print(f"transfer_after_t0_p50_ratio={ratio(lambda r: r['ttft_split_ms']['transfer']['p50']):.4f} "
      f"ttft_p50_ratio={ratio(lambda r: r['ttft_ms']['p50']):.4f} "
      f"second_token_p50_ratio={ratio(lambda r: r['second_token_ms']['p50']):.4f} (streamed over whole)")
PY
