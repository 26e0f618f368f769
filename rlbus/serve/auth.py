"""Bearer-token authentication per tenant: who is asking, so every served record names its tenant.

Tokens come from a file (``--token-file`` / ``$RLBUS_SERVE_TOKEN_FILE``), one ``tenant: token`` per line
(``#`` starts a comment), or from ``$RLBUS_SERVE_TOKENS`` as ``tenant:token,tenant:token`` — never from the
command line, where ``ps`` would show them. A token is looked up by its SHA-256, so the comparison does
not leak how much of a guessed token was right. Tokens shorter than 16 characters, a tenant named twice
or two tenants sharing a token are configuration errors at start.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from rlbus.errors import ApiError, ConfigError

TOKENS_ENV = "RLBUS_SERVE_TOKENS"
TOKEN_FILE_ENV = "RLBUS_SERVE_TOKEN_FILE"
MIN_TOKEN_CHARS = 16
_TENANT = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class Tenants:
    """Token → tenant; ``tenant_of`` turns an ``Authorization`` header into a tenant or a 401."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        """``tokens``: tenant → token."""
        if not tokens:
            raise ConfigError("serve.tokens", f"no tenant tokens: give a token file or set {TOKENS_ENV}")
        self._by_hash: dict[bytes, str] = {}
        for tenant, token in tokens.items():
            if not _TENANT.match(tenant):
                raise ConfigError("serve.tokens", f"tenant {tenant!r} must be 1-64 of [A-Za-z0-9_.-]")
            if len(token) < MIN_TOKEN_CHARS:
                raise ConfigError("serve.tokens", f"tenant {tenant!r}: token shorter than {MIN_TOKEN_CHARS} characters")
            digest = _digest(token)
            if digest in self._by_hash:
                raise ConfigError("serve.tokens", f"tenants {self._by_hash[digest]!r} and {tenant!r} share a token")
            self._by_hash[digest] = tenant

    @property
    def names(self) -> list[str]:
        return sorted(self._by_hash.values())

    def tenant_of(self, authorization: str | None) -> str:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <token>'",
                           type="invalid_request_error", code="invalid_api_key")
        tenant = self._by_hash.get(_digest(token.strip()))
        if tenant is None:
            raise ApiError(401, "incorrect API key", type="invalid_request_error", code="invalid_api_key")
        return tenant


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_token_lines(text: str, *, where: str) -> dict[str, str]:
    """``tenant: token`` lines → {tenant: token}; names the line of any problem."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tenant, sep, token = line.partition(":")
        if not sep or not tenant.strip() or not token.strip():
            raise ConfigError("serve.tokens", f"{where} line {n}: expected 'tenant: token'")
        if tenant.strip() in out:
            raise ConfigError("serve.tokens", f"{where} line {n}: tenant {tenant.strip()!r} given twice")
        out[tenant.strip()] = token.strip()
    return out


def load_tenants(file: Path | None = None, *, env: Mapping[str, str] = os.environ) -> Tenants:
    """Tenants from ``file`` (or ``$RLBUS_SERVE_TOKEN_FILE``), else ``$RLBUS_SERVE_TOKENS``."""
    path = file or (Path(env[TOKEN_FILE_ENV]) if env.get(TOKEN_FILE_ENV) else None)
    if path is not None:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError("serve.token_file", f"cannot read {path}: {exc}") from None
        return Tenants(parse_token_lines(text, where=str(path)))
    return Tenants(parse_token_lines(env.get(TOKENS_ENV, "").replace(",", "\n"), where=f"${TOKENS_ENV}"))
