"""Tenant tokens: file and environment formats, the problems refused at start, 401 bodies."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.errors import ApiError, ConfigError
from rlbus.serve.auth import Tenants, load_tenants

A, B = "a-token-0123456789abcdef", "b-token-0123456789abcdef"


def test_file_and_env_formats(tmp_path: Path) -> None:
    file = tmp_path / "tokens"
    file.write_text(f"# tenants\nacme: {A}\n\nglobex : {B}  # ops\n")
    tenants = load_tenants(file, env={})
    assert tenants.names == ["acme", "globex"]
    assert tenants.tenant_of(f"Bearer {A}") == "acme" and tenants.tenant_of(f"bearer {B}") == "globex"
    from_env = load_tenants(env={"RLBUS_SERVE_TOKENS": f"acme:{A},globex:{B}"})
    assert from_env.tenant_of(f"Bearer {B}") == "globex"
    assert load_tenants(env={"RLBUS_SERVE_TOKEN_FILE": str(file)}).names == ["acme", "globex"]


@pytest.mark.parametrize(("text", "problem"), [
    ("", "no tenant tokens"),
    ("acme: short", "shorter than 16"),
    (f"acme: {A}\nacme: {B}", "given twice"),
    (f"acme: {A}\nglobex: {A}", "share a token"),
    (f"acme {A}", "expected 'tenant: token'"),
    (f"a/b: {A}", "must be 1-64"),
])
def test_bad_token_files_fail_at_start(tmp_path: Path, text: str, problem: str) -> None:
    file = tmp_path / "tokens"
    file.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_tenants(file, env={})


def test_wrong_or_missing_tokens_are_401() -> None:
    tenants = Tenants({"acme": A})
    for header in (None, "", "Basic abc", "Bearer ", f"Bearer {B}", A):
        with pytest.raises(ApiError) as caught:
            tenants.tenant_of(header)
        assert caught.value.status == 401 and caught.value.code == "invalid_api_key"
