#!/usr/bin/env bash
# Builds the release binary here and puts it, with its commit, in .device-bin/ (listed in
# .git/info/exclude), ready to carry to the device machine for benches/device/run.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --locked
mkdir -p .device-bin .git/info
grep -qx '/.device-bin/' .git/info/exclude 2>/dev/null || echo '/.device-bin/' >> .git/info/exclude
cp target/release/kvflow .device-bin/kvflow
strip .device-bin/kvflow
commit=$(git rev-parse --short HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then commit="$commit (with uncommitted changes)"; fi
echo "$commit" > .device-bin/COMMIT
echo "ready: .device-bin/kvflow at $commit — run through the device tool: bash benches/device/run.sh (carry .device-bin)"
