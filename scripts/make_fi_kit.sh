#!/usr/bin/env bash
# make_fi_kit.sh — downloads flashinfer's JIT wheels for the GPU machine (Python 3.12, x86_64) into .fi/, which
# scripts/gpu_check.sh installs (fi_kit) when the device call carries it: carry [".devkit", ".fi"].
#   flashinfer-python 0.5.3 (7 MB), apache-tvm-ffi 0.1.x, nvidia-cudnn-frontend (21 MB together), no dependencies:
#   the GPU image has torch, ninja, einops, click, tabulate, nvidia-ml-py; flashinfer compiles its kernels there
#   with the machine's nvcc on first use (12-65 s a kernel, cached for the rest of the call).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF "/.fi/" .git/info/exclude 2>/dev/null || echo "/.fi/" >> .git/info/exclude
rm -rf .fi && mkdir -p .fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .fi flashinfer-python==0.5.3 "apache-tvm-ffi<0.2" nvidia-cudnn-frontend
du -sh .fi; ls .fi
