#!/usr/bin/env python3
"""Registers, spills and shared memory of each CUDA kernel on Hopper, without a GPU.

    python3 tools/ptx_resources.py [attention.cu bf16.cu ...]   (default: every kernels/cuda/*.cu)

Compiles each source after kernels/cuda/common.cuh with NVRTC for compute_90, as the executor does
(kernels/src/cuda/sources.rs), then assembles the PTX for sm_90 with ptxas -v and prints one line
per kernel: registers, spill stores and loads, static shared memory. NVRTC and ptxas come from
PyPI (nvidia-cuda-nvrtc and nvidia-cuda-nvcc 13.0.88), fetched once into target/test-deps/ as
tools/test.sh fetches NVRTC.
"""
import ctypes
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPS = ROOT / "target" / "test-deps"
VERSION = "13.0.88"


def fetched(package, folder, probe):
    """The folder holding `probe` after pip installed `package` into DEPS/folder (once)."""
    target = DEPS / folder
    hits = list(target.glob(f"**/{probe}"))
    if not hits:
        print(f"ptx_resources: fetching {package}=={VERSION} into {target}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                        "--target", str(target), f"{package}=={VERSION}"], check=True)
        hits = list(target.glob(f"**/{probe}"))
    if not hits:
        sys.exit(f"ptx_resources: {package} has no {probe}")
    return hits[0].parent


def ptx_of(nvrtc, name, source):
    """PTX for compute_90, or exits with NVRTC's log."""
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) != 0:
        sys.exit(f"{name}: nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc != 0:
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{name}: NVRTC failed:\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main():
    lib = fetched("nvidia-cuda-nvrtc", "nvrtc", "libnvrtc.so.13")
    ptxas = fetched("nvidia-cuda-nvcc", "nvcc", "ptxas") / "ptxas"
    # libnvrtc loads its builtins from the same folder
    os.environ["LD_LIBRARY_PATH"] = f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    ctypes.CDLL(str(lib / "libnvrtc-builtins.so.13.0"))
    nvrtc = ctypes.CDLL(str(lib / "libnvrtc.so.13"))
    cuda = ROOT / "kernels" / "cuda"
    common = (cuda / "common.cuh").read_text()
    files = sys.argv[1:] or sorted(p.name for p in cuda.glob("*.cu"))
    out = DEPS / "ptx"
    out.mkdir(parents=True, exist_ok=True)
    for name in files:
        ptx_path = out / f"{name}.ptx"
        ptx_path.write_bytes(ptx_of(nvrtc, name, common + "\n" + (cuda / name).read_text()))
        run = subprocess.run([str(ptxas), "-arch=sm_90", "-v", str(ptx_path), "-o", os.devnull],
                             capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{name}: ptxas failed:\n{run.stderr}")
        kernel, spills = None, ""
        for line in run.stderr.splitlines():
            if m := re.search(r"Compiling entry function '(\w+)'", line):
                kernel, spills = m.group(1), ""
            elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
                spills = f"spills {m.group(1)} B stored, {m.group(2)} B loaded"
            elif kernel and (m := re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)):
                smem = f"{m.group(2)} B static shared" if m.group(2) else "no static shared"
                print(f"{name:<13} {kernel:<26} {m.group(1):>3} registers  {smem:<22} {spills or 'no spills'}")


if __name__ == "__main__":
    main()
