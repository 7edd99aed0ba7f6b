#!/usr/bin/env bash
# A handoff behind a busy producer (issue 42 §0): long prompts arriving faster than one prefill
# rank serves them, handed off over tcp on loopback (graphs/pd-1p1d-tcp.toml's pools and link, no
# link rate) to one decode rank. Prints the TTFT split's transfer (T0 sampled → the decode rank
# took the handoff) and TTFT, p50 and p99, for the run as it is — each handoff carries the copy
# the step that completed its prompt made — and, in the same invocation, for the baseline of
# reading the producer's blocks in place through its cache lock (`--test-switch
# read-handoffs-in-place`, how CPU handoffs were read before), which waits for each of the
# producer's later steps. Both runs use --verify.
#     bash benches/busy-producer.sh [PROMPT_TOKENS=4096] [REQUESTS=8] [GAP_MS=1800]
# Needs a release build; writes under target/busy-producer/. The model is the seeded Llama-shaped
# benches/specs/mha_small.toml (4 layers, hidden 512; not a fixture), written there once.
set -euo pipefail
cd "$(dirname "$0")/.."
tokens=${1:-4096} requests=${2:-8} gap=${3:-1800}
bin=./target/release/kvflow
[ -x "$bin" ] || { echo "no $bin: cargo build --release first" >&2; exit 2; }
work=target/busy-producer
mkdir -p "$work"
[ -f "$work/model/model.safetensors" ] || "$bin" seed-checkpoint benches/specs/mha_small.toml "$work/model" >/dev/null
python3 benches/long_prompts.py "$work/trace.jsonl" "$tokens" "$requests" "$gap"
root=$(pwd)
sed -e "s#^path = .*#path = \"$root/$work/model\"#" \
    -e "s#^budget_bytes = .*#budget_bytes = \"1 GiB\"#" \
    -e "s#^max_batched_tokens = .*#max_batched_tokens = 512#" \
    -e "s#^chunk_tokens = .*#chunk_tokens = 512#" \
    -e "s#^trace = .*#trace = \"$root/$work/trace.jsonl\"#" \
    -e "s#^time_scale = .*#time_scale = 1.0#" \
    -e "s#^warmup = .*#warmup = 0#" \
    -e "s#^limit = .*#limit = $requests#" \
    -e "s#^max_output_tokens = .*#max_output_tokens = 8#" \
    -e "s#^block_tokens = .*#block_tokens = 512#" \
    -e "s#^out = .*#out = \"$root/$work/out\"#" graphs/pd-1p1d-tcp.toml > "$work/graph.toml"
echo "busy producer: $requests prompts of $tokens tokens, $gap ms apart, 1P1D over tcp on loopback, model benches/specs/mha_small.toml, commit $(git rev-parse --short HEAD), $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ)"
run() {
    local label=$1; shift
    "$bin" run "$work/graph.toml" --verify --out "$work/out-$label" "$@" >"$work/$label.log" 2>&1 ||
        { echo "$label: the run failed (see $work/$label.log)"; tail -3 "$work/$label.log"; exit 1; }
    python3 - "$label" "$work/out-$label/report.json" <<'PY'
import json, sys
label, path = sys.argv[1], sys.argv[2]
r = json.load(open(path)); s = r["ttft_split_ms"]
print(f"{label:<9} transfer p50 {s['transfer']['p50']:9.1f} ms p99 {s['transfer']['p99']:9.1f} ms | "
      f"prefill p50 {s['prefill']['p50']:8.1f} ms | TTFT p50 {r['ttft_ms']['p50']:8.1f} ms p99 {r['ttft_ms']['p99']:8.1f} ms | "
      f"handoff {r['handoff']['bytes'] / r['handoff']['count'] / 1e6:.1f} MB each | completed {r['completed']}/{r['requests']}, "
      f"verify {r['verify']['mismatched']}/{r['verify']['checked']} mismatched")
PY
}
run owned
run in-place --test-switch read-handoffs-in-place
python3 - "$work/out-owned/report.json" "$work/out-in-place/report.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["ttft_split_ms"]["transfer"]["p50"] for p in sys.argv[1:])
print(f"transfer_p50_ratio={a / b:.4f} (owned copy over in-place reads)")
PY
