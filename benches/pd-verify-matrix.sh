#!/usr/bin/env bash
# The P/D verify matrix: every checkpoint of fixtures/hf and fixtures/hf-extra through the three
# P/D graphs and pd-1p1d with a [pool.disaggregation] rule, --verify. Needs a release build.
# Usage: benches/pd-verify-matrix.sh > benches/results/DATE-pd-verify-matrix.txt
cd "$(dirname "$0")/.." && root=$(pwd)
B=./target/release/kvflow
cond=$(mktemp --suffix=.toml)
sed 's/^\[\[link\]\]$/[pool.disaggregation]\nremote_prefill_min_tokens = 100\n\n[[link]]/' graphs/pd-1p1d.toml > $cond
sed -i "s|\"\.\./|\"$root/|g" $cond
grep -q remote_prefill_min_tokens $cond || { echo "no rule in $cond"; exit 1; }
echo "# kvflow P/D verify matrix: kvflow run GRAPH --model M --limit 10 --verify (pd-1p1d-cond: pd-1p1d.toml with [pool.disaggregation] remote_prefill_min_tokens = 100)"
echo "# $(date -u +%Y-%m-%dT%H:%MZ) commit $(git rev-parse --short HEAD), 2 cores; every whole-graph run routes new requests to a decode rank first"
row() {
  local m=$1 g=$2 file=$3 out
  out=$(mktemp -d)
  $B run $file --model $m --limit 10 --verify --out $out >/dev/null 2>$out.err
  [ -f $out/report.json ] || { echo "$m $g FAILED: $(tail -1 $out.err)"; return; }
  python3 - "$m" "$g" $out <<'PY'
import json, sys
m, g, out = sys.argv[1:]
r = json.load(open(out + "/report.json")); h = r["handoff"]; v = r["verify"]
fails = ",".join(sorted(r["failures"])) or "-"
print(f"{m:<48} {g:<13} verify {v['mismatched']}/{v['checked']} mismatched | completed {r['completed']}/{r['requests']} (failed: {fails}) handoffs {h['count']} local {h['local_prefills']} socket_bytes {h['socket_bytes']} saved {h['saved_bytes']} accounting_errors {len(r['accounting_errors'])}")
PY
}
for m in fixtures/hf/*/ fixtures/hf-extra/*/; do
  m=${m%/}
  for g in pd-1p1d pd-1p1d-tcp pd-2p4d; do row $m $g graphs/$g.toml; done
  row $m pd-1p1d-cond $cond
done
