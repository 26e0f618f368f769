#!/usr/bin/env bash
# The Python packages `make gpu-check` needs that a GPU machine's image lacks (its python3 is 3.12 with torch,
# transformers, numpy, numba, typer, rich, aiohttp, xxhash, pytest …, but not these), as CPython 3.12 manylinux
# x86-64 wheels in .whl/ (ignored by git; about 10 MB). Run it here, where a package index is reachable; the
# GPU machine cannot reach one. `make gpu-check` installs whatever is in .whl/ with --no-index --target before
# it runs, so carry .whl with the call (the device tool's `carry`).
#   infra/gpu/wheels.sh            # downloads into .whl/
#   PYTHON=python3.11 infra/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
# rlbus's own dependencies the image lacks, the test plugin its async tests need, and GGUF reading; the
# versions the project's CI runs.
WHEELS=(
  msgspec==0.23.0
  zstandard==0.25.0
  lz4==4.4.5
  aiokafka==0.14.0
  async-timeout==5.0.1
  redis==8.2.0
  pytest-asyncio==1.5.0
  gguf==0.19.0
)
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls .whl
du -sh .whl
