#!/usr/bin/env bash
# Run HERE (with network) before scripts/device_check.sh is sent to a GPU
# machine: downloads into .device_wheels/ (git-ignored; carry it along) the
# small wheels raylm needs that such a machine lacks, for CPython 3.10-3.12,
# since its Python version is not known in advance. The GPU machine has no
# network and no Ray; raylm's uni executor does not need Ray.
#
# FlashInfer is not brought: flashinfer-python is a ~97 MiB wheel (over the
# 64 MiB a device run may carry) that JIT-compiles its kernels with the CUDA
# toolkit at first use. Without it raylm's GPU attention uses torch SDPA.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.device_wheels
mkdir -p "$DEST"
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

for py in 3.10 3.11 3.12; do
  # Compiled: one wheel per Python version.
  pip download --quiet --no-deps --only-binary=:all: --python-version "$py" "${PLATFORMS[@]}" \
    -d "$DEST" msgspec pyzmq
done
# abi3 / pure Python: one wheel serves all versions. pytest and its few
# dependencies (the GPU machine may not have a test runner).
pip download --quiet --no-deps --only-binary=:all: --python-version 3.10 "${PLATFORMS[@]}" -d "$DEST" \
  psutil pytest pluggy iniconfig packaging pytest-timeout exceptiongroup tomli
# gguf (a dependency of raylm: GGUF checkpoints), pure Python, at the version CI pins.
pip download --quiet --no-deps --only-binary=:all: -d "$DEST" "$(grep -i '^gguf==' constraints.txt)"

du -sh "$DEST"
ls "$DEST"
