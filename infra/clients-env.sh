#!/usr/bin/env bash
# Build the client-matrix environment (default .venv-clients in the checkout; RLBUS_CLIENTS_VENV overrides):
# the agent and eval frameworks tests/integration/test_clients.py drives `rlbus serve` with, each as a user
# installs it. They get a venv of their own because the OpenAI Agents SDK needs openai>=3 while the `envs`
# extra's verifiers (<0.5) needs openai<3: one environment cannot hold both. Only the clients go in (no
# torch, no rlbus): the gateway runs in the test's own environment and each client runs as a process here.
# boto3 is pinned to the release both litellm (>=1.43.117) and inspect-ai's s3fs (botocore<1.43.118) accept,
# which pip's resolver otherwise backtracks through hundreds of inspect-ai releases to find.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${RLBUS_CLIENTS_VENV:-.venv-clients}"
start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install -q -U pip
"${pip[@]}" install -q -r infra/clients-requirements.txt
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
print(", ".join(f"{p} {version(p)}" for p in ("openai", "openai-agents", "litellm", "inspect-ai")))
PY
echo "client environment at $VENV: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
