#!/usr/bin/env bash
# The KV-aware router against least-outstanding, round-robin and the one-rank bound on one window of
# a Mooncake trace (issue 42 §4). The three graphs/router-*.toml graphs (4 ranks of 16 MiB) with
# their trace swapped for the window, and a fourth graph: one rank holding all four ranks' memory,
# the bound no router over four ranks can beat (every prefix lands where the next request finds
# it). One `kvflow compare` of the four, then prefix hit rates and the ratios the issue asks for.
#     bash benches/router.sh [TRACE=traces/mooncake_synthetic_tail500.jsonl] [FIRST_LINE=201] [COUNT=300]
# The model is the seeded Qwen3-shaped benches/specs/qwen3_router.toml (not a fixture; SPEC names
# another seeded spec), written once under target/router/. VERIFY=1 adds --verify; BIN another
# build. Needs a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
trace=${1:-traces/mooncake_synthetic_tail500.jsonl} first=${2:-201} count=${3:-300}
bin=${BIN:-./target/release/kvflow}
[ -x "$bin" ] || { echo "no $bin: cargo build --release first" >&2; exit 2; }
root=$(pwd)
spec=${SPEC:-benches/specs/qwen3_router.toml}
model=target/router/$(basename "$spec" .toml)
[ -f "$model/model.safetensors" ] || "$bin" seed-checkpoint "$spec" "$model" >/dev/null
work=target/router/$(basename "$spec" .toml)-$(basename "$trace" .jsonl)-$first-$count
mkdir -p "$work"
sed -n "${first},$((first + count - 1))p" "$trace" >"$work/trace.jsonl"
[ "$(wc -l <"$work/trace.jsonl")" -eq "$count" ] || { echo "$trace has fewer than $((first + count - 1)) lines" >&2; exit 2; }
swap() {  # swap SOURCE_GRAPH NAME [SED_EXPR...]
    local source=$1 name=$2
    shift 2
    sed -e "s#^path = .*#path = \"$root/$model\"#" \
        -e "s#^trace = .*#trace = \"$root/$work/trace.jsonl\"#" \
        -e "s#^limit = .*#limit = $count#" \
        -e "s#^out = .*#out = \"$root/$work/$name\"#" "$@" "$source" >"$work/$name.toml"
}
for router in kv-aware least-outstanding round-robin; do
    swap "graphs/router-$router.toml" "router-$router"
done
# the bound: one rank, four ranks' memory
swap graphs/router-round-robin.toml one-rank-bound -e 's#^ranks = .*#ranks = 1#' -e 's#^budget_bytes = .*#budget_bytes = "64 MiB"#'
date -u
git rev-parse --short HEAD
echo "window: $trace lines $first-$((first + count - 1)); model: seeded $spec"
verify=()
[ "${VERIFY:-0}" = 1 ] && verify=(--verify)
"$bin" compare "$work"/router-kv-aware.toml "$work"/router-least-outstanding.toml "$work"/router-round-robin.toml \
    "$work"/one-rank-bound.toml --out "$work/compare" "${verify[@]}"
python3 - "$work/compare" <<'PY'
import json, sys, os
out = sys.argv[1]
def report(name):
    return json.load(open(os.path.join(out, name, "report.json")))
hit = {n: report(n)["prefix_hit_rate"] for n in ["router-kv-aware", "router-least-outstanding", "router-round-robin", "one-rank-bound"]}
kv, lo, bound = hit["router-kv-aware"], hit["router-least-outstanding"], hit["one-rank-bound"]
print(f"hit rate: kv-aware {kv:.3f}, least-outstanding {lo:.3f}, round-robin {hit['router-round-robin']:.3f}, one-rank bound {bound:.3f}")
print(f"kv-aware of bound {kv / bound if bound else 0:.3f} (goal >= 0.9); over least-outstanding {kv / lo if lo else 0:.3f} (goal >= 1.15)")
PY
