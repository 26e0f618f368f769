"""Scoped blob keys (rlbus/blobs/keys.py): minting, the credential's round trip, and every way a key that
was not minted from this master, or is used outside its claims, is refused. No server: the HTTP side is
tests/integration/test_blob_keys_http.py."""

from __future__ import annotations

import base64
import json

import pytest
from typer.testing import CliRunner

from rlbus.blobs.http import HttpStore, sign
from rlbus.blobs.keys import (
    ROLES,
    KeyClaims,
    ScopedKey,
    derive,
    is_scoped,
    mint,
    mint_for_role,
    normalise_prefix,
    parse_permissions,
    parse_ttl,
    verify_claims,
)
from rlbus.blobs.open import open_store
from rlbus.errors import ConfigError

MASTER = "master-secret-for-tests"
NOW = 1_800_000_000.0


def test_roles_map_to_least_privilege() -> None:
    assert ROLES["trainer"] == {"read", "write", "delete", "list"}
    assert ROLES["worker"] == {"read"}
    assert ROLES["relay"] == {"read"}
    assert ROLES["operator"] == {"read", "list", "delete"}


def test_minting_for_a_role() -> None:
    key = mint_for_role(MASTER, "worker", prefix="run7", ttl="7d", key_id="w-1", now=NOW)
    assert is_scoped(key) and key.startswith("rbk1.") and MASTER not in key
    parsed = ScopedKey.parse(key)
    assert parsed.claims == KeyClaims("w-1", frozenset({"read"}), "run7/", int(NOW) + 7 * 86400)
    assert parsed.secret == derive(MASTER, parsed.claims)
    assert MASTER not in repr(parsed) and parsed.secret not in repr(parsed)
    # --permissions replaces the role's set; no TTL never expires; a default id names the role
    custom = ScopedKey.parse(mint_for_role(MASTER, "worker", permissions="read, write")).claims
    assert custom.permissions == {"read", "write"} and custom.expires is None and custom.prefix == ""
    assert custom.key_id.startswith("worker-")


def test_credential_round_trip_and_canonical_claims() -> None:
    claims = KeyClaims("op", frozenset({"list", "read", "delete"}), "runs/exp1/", 1234)
    key = mint(MASTER, claims)
    encoded = key.split(".")[1]
    raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    assert raw == b'{"exp":1234,"id":"op","perm":["read","delete","list"],"prefix":"runs/exp1/"}'
    assert KeyClaims.decode(encoded) == claims
    assert str(ScopedKey.parse(key)) == key
    assert verify_claims(MASTER, encoded) == (claims, ScopedKey.parse(key).secret)


def _tamper(key: str, **changes: object) -> str:
    """The key with its claims edited and its derived secret kept (what a holder can do without the master)."""
    _, encoded, derived = key.split(".")
    data = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    data.update(changes)
    raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return f"rbk1.{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}.{derived}"


def test_tampered_claims_derive_another_secret() -> None:
    key = mint_for_role(MASTER, "worker", prefix="run7/", ttl=60, now=NOW)
    held = ScopedKey.parse(key).secret
    for changes in ({"perm": ["read", "write"]}, {"prefix": ""}, {"exp": None}, {"exp": int(NOW) + 10**6},
                    {"id": "trainer"}):
        forged = ScopedKey.parse(_tamper(key, **changes))
        # the server derives the secret from the claims it is sent: not the one the holder signs with
        _, expected = verify_claims(MASTER, forged.claims.encode())
        assert expected != held
        assert sign(held, "PUT", "run7/x", 9) != sign(expected, "PUT", "run7/x", 9)


def test_a_key_from_another_master_is_not_this_masters() -> None:
    claims = KeyClaims("w", frozenset({"read"}))
    theirs = ScopedKey.parse(mint("another-master", claims))
    _, ours = verify_claims(MASTER, theirs.claims.encode())
    assert theirs.secret != ours
    with pytest.raises(ConfigError, match="master secret"):
        mint(mint(MASTER, claims), claims)  # a scoped key cannot mint keys


@pytest.mark.parametrize(
    "encoded",
    [
        "!!!",
        base64.urlsafe_b64encode(b"not json").decode(),
        base64.urlsafe_b64encode(b'{"exp":null,"id":"w","perm":["read"]}').decode(),  # prefix missing
        base64.urlsafe_b64encode(b'{"exp":null,"id":"w","perm":["root"],"prefix":""}').decode(),
        base64.urlsafe_b64encode(b'{"exp":"soon","id":"w","perm":["read"],"prefix":""}').decode(),
        base64.urlsafe_b64encode(b'{"exp":null,"id":"w","perm":["read"],"prefix":"run7"}').decode(),
        base64.urlsafe_b64encode(b'{"exp":null,"id":"w","perm":["read"],"prefix":"../"}').decode(),
        base64.urlsafe_b64encode(b'{"prefix":"","exp":null,"id":"w","perm":["read"]}').decode(),  # not canonical
        "A" * 5000,
    ],
)
def test_malformed_claims_are_refused(encoded: str) -> None:
    with pytest.raises(ValueError):
        verify_claims(MASTER, encoded)


def test_expired_key_is_refused() -> None:
    claims = ScopedKey.parse(mint_for_role(MASTER, "worker", ttl="1h", now=NOW)).claims
    assert claims.refusal("GET", "m/1/a", now=NOW + 3599) is None
    reason = claims.refusal("GET", "m/1/a", now=NOW + 3600)
    assert reason is not None and "expired" in reason


def test_permissions_per_method() -> None:
    worker = KeyClaims("w", frozenset({"read"}))
    assert worker.refusal("GET", "m/1/a") is None and worker.refusal("HEAD", "m/1/a") is None
    for method, permission in (("PUT", "write"), ("DELETE", "delete"), ("LIST", "list")):
        reason = worker.refusal(method, "m/1/a")
        assert reason is not None and permission in reason and "'w'" in reason
    operator = KeyClaims("op", ROLES["operator"])
    assert operator.refusal("DELETE", "m/1/a") is None and operator.refusal("LIST", "") is None
    assert operator.refusal("PUT", "m/1/a") is not None


@pytest.mark.parametrize("key", ["run70/x", "run7", "run8/run7/x", "../run7/x", "run7/../run8/x", "run7/./x",
                                 "run7//x", "/run7/x"])
def test_prefix_scope_is_on_path_segments(key: str) -> None:
    scoped = KeyClaims("w", frozenset({"read", "list"}), normalise_prefix("run7"))
    assert scoped.prefix == "run7/"
    assert scoped.refusal("GET", "run7/0000000003/delta-00000") is None
    assert scoped.refusal("GET", key) is not None


def test_list_prefix_must_lie_under_the_scope() -> None:
    scoped = KeyClaims("w", frozenset({"list"}), "run7/")
    assert scoped.refusal("LIST", "run7/") is None and scoped.refusal("LIST", "run7/0000000003/") is None
    for prefix in ("", "run", "run7", "run70/", "run8/"):
        assert scoped.refusal("LIST", prefix) is not None


@pytest.mark.parametrize(("text", "seconds"), [("3600s", 3600), ("3600", 3600), ("30m", 1800), ("12h", 43200),
                                               ("7d", 604800), ("2w", 1209600), (" 7D ", 604800)])
def test_parse_ttl(text: str, seconds: int) -> None:
    assert parse_ttl(text) == seconds


@pytest.mark.parametrize("text", ["", "7 days", "-1d", "0s", "1.5h", "forever"])
def test_bad_ttl_names_the_field(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_ttl(text)
    assert info.value.field == "ttl"


def test_unknown_role_permission_and_prefix_name_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        mint_for_role(MASTER, "admin")
    assert info.value.field == "role" and "worker" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_permissions("read,root")
    assert info.value.field == "permissions"
    with pytest.raises(ConfigError) as info:
        mint_for_role(MASTER, "worker", prefix="../etc")
    assert info.value.field == "prefix"
    with pytest.raises(ConfigError) as info:
        mint_for_role(MASTER, "worker", ttl="soon")
    assert info.value.field == "ttl"


def test_clients_take_a_scoped_key_as_their_secret() -> None:
    key = mint_for_role(MASTER, "worker")
    store = open_store("http://127.0.0.1:1", secret=key)
    assert isinstance(store, HttpStore) and store.scoped is not None
    assert store.scoped.claims.permissions == {"read"}
    assert isinstance(HttpStore("http://127.0.0.1:1", secret=MASTER), HttpStore)
    with pytest.raises(ConfigError) as info:
        HttpStore("http://127.0.0.1:1", secret="rbk1.garbage")
    assert info.value.field == "blobs.secret" and "garbage" not in str(info.value)


def test_cli_prints_only_the_key_on_stdout() -> None:
    from rlbus.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["blobs", "key", "--role", "worker", "--prefix", "run7", "--ttl", "7d",
                                 "--name", "w-eu"], env={"RLBUS_BLOB_SECRET": MASTER, "RLBUS_BLOB_SECRET_FILE": ""})
    assert result.exit_code == 0, result.output
    key = result.stdout.strip()
    assert "\n" not in key and MASTER not in result.output
    claims = ScopedKey.parse(key).claims
    assert claims.key_id == "w-eu" and claims.permissions == {"read"} and claims.prefix == "run7/"
    assert ScopedKey.parse(key).secret == derive(MASTER, claims)
    assert "w-eu" in result.stderr and "run7/" in result.stderr
    bad = runner.invoke(app, ["blobs", "key", "--role", "admin"], env={"RLBUS_BLOB_SECRET": MASTER})
    assert bad.exit_code == 1 and "'role'" in bad.output and bad.stdout == ""
    bad = runner.invoke(app, ["blobs", "key", "--role", "worker", "--ttl", "soon"], env={"RLBUS_BLOB_SECRET": MASTER})
    assert bad.exit_code == 1 and "'ttl'" in bad.output
    missing = runner.invoke(app, ["blobs", "key", "--role", "worker"], env={"RLBUS_BLOB_SECRET": ""})
    assert missing.exit_code != 0 and "RLBUS_BLOB_SECRET" in missing.output


def test_a_write_prefix_confines_writes_and_deletes_but_not_reads() -> None:
    key = mint_for_role(MASTER, "rollout", write_prefix="claims/", now=NOW)
    claims = ScopedKey.parse(key).claims
    assert claims.permissions == {"read", "write"} and claims.write_prefix == "claims/"
    assert claims.refusal("PUT", "claims/rl.rollouts.v1/20261202T17/ab", now=NOW) is None
    assert claims.refusal("GET", "policy/0000000007/manifest.json", now=NOW) is None
    refusal = claims.refusal("PUT", "policy/0000000008/manifest.json", now=NOW)
    assert refusal is not None and "only under 'claims/'" in refusal
    assert claims.refusal("PUT", "claimsX/x", now=NOW) is not None  # a prefix is whole path segments


def test_dropping_the_write_prefix_from_the_claims_derives_another_secret() -> None:
    key = mint_for_role(MASTER, "rollout", write_prefix="claims/", now=NOW)
    encoded = key.split(".")[1]
    data = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    assert data["wprefix"] == "claims/"
    del data["wprefix"]
    widened = KeyClaims(data["id"], frozenset(data["perm"]), data["prefix"], data["exp"])
    _, expected = verify_claims(MASTER, widened.encode())
    assert expected != ScopedKey.parse(key).secret


def test_a_write_prefix_must_lie_inside_the_prefix() -> None:
    with pytest.raises(ConfigError, match="write_prefix"):
        KeyClaims("k", frozenset({"read", "write"}), "run7/", None, "claims/")
    with pytest.raises(ConfigError, match="write_prefix"):
        KeyClaims("k", frozenset({"write"}), "", None, "")
