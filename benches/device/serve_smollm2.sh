#!/usr/bin/env bash
# SmolLM2-135M-Instruct served on the GPU: `kvflow serve graphs/smollm2.toml` twice on loopback,
# once as the graph is (executor = "cpu") and once with executor = "cuda", then
# benches/device/serve_compare.py sends both the same 20 chat prompts (greedy, 96 tokens at most;
# every one also streamed from the cuda server) and compares the texts. Raw output goes to
# $OUT/serve-smollm2.txt (or ./serve-smollm2.txt); exits non-zero when any text differs.
#
# The device machine reaches no network, and one call carries 64 MiB with the working tree: the
# GGUF (98 MB) goes over in pieces, one a call, on a warm machine: `bash
# benches/device/serve_smollm2.sh --split` here writes .device-gguf-1 … -4 (listed in
# .git/info/exclude); each call carries one and copies it into /tmp/smollm2-pieces (a carried
# folder is gone at the next call, /tmp stays while the machine is warm) —
#     mkdir -p /tmp/smollm2-pieces && cp .device-gguf-*/* /tmp/smollm2-pieces/
# — and the last call (carrying .device-bin and .device-gguf-4) runs this script there.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--split" ]; then
    src=$(bash tools/fetch_smollm2.sh) || exit 1
    exclude=$(git rev-parse --git-path info/exclude)
    rm -rf .device-gguf-*
    split -n 4 -d -a 1 "$src" /tmp/smollm2-piece-
    for i in 0 1 2 3; do
        dir=".device-gguf-$((i + 1))"
        mkdir -p "$dir" && mv "/tmp/smollm2-piece-$i" "$dir/piece-$i"
        grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
    done
    sha256sum "$src" | cut -d' ' -f1 > .device-gguf-4/SHA256
    du -sh .device-gguf-*
    exit 0
fi
out="${OUT:-.}/serve-smollm2.txt"
bin=.device-bin/kvflow
source benches/device/binaries.sh
exec > >(tee "$out") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
source benches/device/smollm2_gguf.sh || exit 1
sed -e 's/^executor = "cpu"/executor = "cuda"/' graphs/smollm2.toml > graphs/.smollm2-cuda.toml
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -f graphs/.smollm2-cuda.toml' EXIT
"$bin" serve graphs/smollm2.toml --model "$gguf" --port 18101 --out /tmp/serve-cpu > /tmp/serve-cpu.log 2>&1 &
pids+=($!)
"$bin" serve graphs/.smollm2-cuda.toml --model "$gguf" --port 18102 --out /tmp/serve-cuda > /tmp/serve-cuda.log 2>&1 &
pids+=($!)
python3 benches/device/serve_compare.py http://127.0.0.1:18101 http://127.0.0.1:18102
status=$?
kill -TERM "${pids[@]}" 2>/dev/null
wait "${pids[@]}" 2>/dev/null
echo "== cuda server log (tail)"
tail -n 5 /tmp/serve-cuda.log
echo "exit status: $status"
exit $status
