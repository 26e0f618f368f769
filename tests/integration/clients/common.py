"""What every client program shares: the gateway's address and token from the environment, closing a session
with the standard library (the reward route is on the gateway's root, not under /v1), one JSON line out."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from typing import Any

BASE_URL = os.environ["RLBUS_BASE_URL"]  # http://host:port/v1
API_KEY = os.environ["RLBUS_API_KEY"]
MODEL = os.environ["RLBUS_MODEL"]
PREFIX = os.environ["RLBUS_SESSION_PREFIX"]


def close(session_id: str, reward: float) -> dict[str, Any]:
    """``POST /rl/sessions/<id>/reward``: the 202 receipt (an HTTP error raises)."""
    root = BASE_URL.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(
        f"{root}/rl/sessions/{session_id}/reward", data=json.dumps({"reward": reward}).encode(), method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return dict(json.load(response))


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)
    sys.stdout.flush()
