#!/usr/bin/env bash
# Builds the release binary here and puts it, with its commit, in .device-bin/ (listed in
# .git/info/exclude), ready to carry to the device machine for benches/device/run.sh and
# speed.sh. Also keeps in .device-bin/wheels/ the pure-python wheels speed.sh installs there
# (the device machine reaches no registry): fla-core and flash-linear-attention 0.6.0, the
# flash-linear-attention kernels transformers' kimi_linear binds when importable, and einops
# 0.8.2, fla-core's one requirement beside torch and triton (both on the device). Downloaded once.
#     bash benches/device/prepare.sh [--wheels-only] [--also COMMIT]
# --also COMMIT builds that commit too (in a worktree under target/, into a target folder of its
# own: the first build compiles every dependency) into .device-bin/kvflow-COMMIT, for sweep.sh's
# `at=COMMIT` variants; other commits' builds there are removed (a device call carries 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .device-bin/wheels
# (a worktree's .git is a file: ask git where its exclude file is)
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.device-bin/' "$exclude" 2>/dev/null || echo '/.device-bin/' >> "$exclude"
wheels=(fla_core-0.6.0-py3-none-any.whl flash_linear_attention-0.6.0-py3-none-any.whl einops-0.8.2-py3-none-any.whl)
missing=0
for w in "${wheels[@]}"; do [ -f ".device-bin/wheels/$w" ] || missing=1; done
if [ "$missing" = 1 ]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --dest .device-bin/wheels \
        fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2
fi
for w in "${wheels[@]}"; do
    [ -f ".device-bin/wheels/$w" ] || { echo "pip download gave no .device-bin/wheels/$w (a wheel for every python, none-any)" >&2; exit 1; }
done
echo "wheels: $(ls .device-bin/wheels | tr '\n' ' ')"
[ "${1:-}" = "--wheels-only" ] && exit 0
if [ "${1:-}" = "--also" ]; then
    [ -n "${2:-}" ] || { echo "--also takes a commit" >&2; exit 2; }
    also=$(git rev-parse --short "$2^{commit}") || { echo "--also $2: not a commit here" >&2; exit 2; }
    tree="target/also-$also"
    git worktree prune  # (a worktree whose folder went with target/ is forgotten)
    [ -d "$tree" ] || git worktree add --detach "$tree" "$also" >/dev/null
    (cd "$tree" && CARGO_TARGET_DIR="$PWD/../also-target" cargo build --release --locked --bin kvflow)
    find .device-bin -maxdepth 1 -name 'kvflow-*' ! -name "kvflow-$also.xz" -delete
    cp "target/also-target/release/kvflow" ".device-bin/kvflow-$also"
    strip ".device-bin/kvflow-$also"
    xz -T0 -6 -f ".device-bin/kvflow-$also"  # (binaries.sh unpacks it there)
    echo "ready: .device-bin/kvflow-$also (sweep.sh variants with at=$also)"
    shift 2
fi
cargo build --release --locked
cp target/release/kvflow .device-bin/kvflow
strip .device-bin/kvflow
xz -T0 -6 -f .device-bin/kvflow  # (binaries.sh unpacks it there)
commit=$(git rev-parse --short HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then commit="$commit (with uncommitted changes)"; fi
echo "$commit" > .device-bin/COMMIT
echo "ready: .device-bin/kvflow at $commit — run through the device tool, carrying .device-bin: bash benches/device/run.sh, bash benches/device/speed.sh"
