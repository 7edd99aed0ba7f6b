#!/usr/bin/env bash
# kvflow's CUDA executor against transformers on the same GPU, weights and dtype, in one device
# call (see benches/README.md): `bash benches/device/prepare.sh` here, then through the device
# tool, carrying .device-bin:
#     bash benches/device/speed.sh
# Writes the seeded 2.0 B hybrid_kda model of benches/device/kimi-2b.toml as a checkpoint, times
# transformers on it (benches/device/transformers_speed.py), then `kvflow bench speed` beside
# those figures, then the P/D graph against the aggregated one on this GPU (kvflow compare). Raw
# output goes to $OUT/speed-run.txt (or ./speed-run.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}/speed-run.txt"
bin=.device-bin/kvflow
if [ ! -x "$bin" ]; then echo "no $bin: run benches/device/prepare.sh first and carry .device-bin" >&2; exit 2; fi
ckpt=${SPEED_CHECKPOINT:-/tmp/kimi-2b}
exec > >(tee "$out") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
start=$(date +%s)
if [ ! -f "$ckpt/model.safetensors" ]; then
    echo "== kvflow seed-checkpoint benches/device/kimi-2b.toml $ckpt"
    "$bin" seed-checkpoint benches/device/kimi-2b.toml "$ckpt" || exit 1
fi
echo "== transformers (benches/device/transformers_speed.py) [$(( $(date +%s) - start )) s]"
python3 benches/device/transformers_speed.py "$ckpt" /tmp/transformers-speed.json || status=1
echo "== kvflow bench speed [$(( $(date +%s) - start )) s]"
baseline=()
[ -f /tmp/transformers-speed.json ] && baseline=(--baseline /tmp/transformers-speed.json)
"$bin" bench speed --model "$ckpt" "${baseline[@]}" || status=1
# P/D against aggregated on the one GPU (both graphs with executor = "cuda", the same trace, seed
# and 40 requests), side by side through kvflow compare
for graph in cuda-aggregated pd-1p1d; do
    sed -e 's/^executor = "cpu"/executor = "cuda"/' -e "s#out/$graph#out/compare-$graph#" "graphs/$graph.toml" > "graphs/.compare-$graph.toml"
done
echo "== kvflow compare cuda-aggregated pd-1p1d (executor = cuda, both on this GPU) --limit 40 --verify [$(( $(date +%s) - start )) s]"
"$bin" compare graphs/.compare-cuda-aggregated.toml graphs/.compare-pd-1p1d.toml --limit 40 --verify 2>&1 | tail -n 30 || status=1
rm -f graphs/.compare-cuda-aggregated.toml graphs/.compare-pd-1p1d.toml
echo "== done in $(( $(date +%s) - start )) s, status $status"
exit $status
