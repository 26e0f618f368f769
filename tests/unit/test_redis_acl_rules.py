"""The Redis ACL rules per role (rlbus/security/redis_acl.py), as rendered: every key pattern under the run's
prefix, write-only roles write-only, no dangerous command for anyone but the operator; URLs and passwords."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rlbus.launch.config import config_from_dict
from rlbus.security import redis_acl
from rlbus.security.redis_acl import ROLES, role_rules, role_url, setuser_args

NON_OPERATORS = [r for r in ROLES if r != "operator"]


def patterns(args: list[str]) -> list[str]:
    """The key globs of rendered rules, without their ``~`` / ``%R~`` / ``%W~``."""
    return [a.split("~", 1)[1] for a in args if a.startswith(("~", "%"))]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("namespace", ["runA", "run-b.7", ""])
def test_every_key_pattern_is_under_the_runs_prefix(role: str, namespace: str) -> None:
    prefix = config_from_dict({"run": {"namespace": namespace}}, {}).state_prefix  # what the workers use
    globs = patterns(setuser_args(role, namespace))
    assert globs and all(g.startswith(prefix) and g != prefix + "*" for g in globs)
    assert role_rules(role, namespace).username == (f"rlbus-{namespace}-{role}" if namespace else f"rlbus-{role}")


def test_namespaces_get_disjoint_patterns() -> None:
    a, b = (set(patterns(setuser_args("operator", ns))) for ns in ("runA", "runB"))
    assert a.isdisjoint(b)
    assert all(g.startswith("rlbus:runA:") for g in a) and all(g.startswith("rlbus:runB:") for g in b)
    # A run without a namespace: the same kinds right under rlbus:, never rlbus:* (every namespace's keys).
    plain = patterns(setuser_args("operator", ""))
    assert "rlbus:*" not in plain and "rlbus:once:*" in plain


@pytest.mark.parametrize("role", NON_OPERATORS)
def test_no_dangerous_command_or_unscoped_access_outside_the_operator(role: str) -> None:
    args = setuser_args(role, "runA")
    for forbidden in ("+@all", "+@admin", "+@dangerous", "+@scripting", "+@pubsub", "allcommands", "allkeys",
                      "~*", "allchannels", "+flushall", "+config", "+acl", "+keys"):
        assert forbidden not in args
    assert not any(a.startswith("&") for a in args)  # no pub/sub channel
    # The denials come after every grant (rules apply left to right) and before the commands.
    rules = role_rules(role, "runA")
    assert rules.categories[-3:] == ("-@scripting", "-@admin", "-@dangerous")
    assert args[:3] == ["reset", "resetchannels", "on"]


def test_trainer_owns_the_ledger_and_buffer_and_may_run_only_its_scripts() -> None:
    args = setuser_args("trainer", "runA")
    assert "~rlbus:runA:once:*" in args and "~rlbus:runA:buf:*" in args
    assert "~rlbus:runA:ctr:*" not in args and not any("ctr:prompts" in a for a in args)
    assert {"+evalsha", "+script|load"} <= set(args) and "+eval" not in args
    assert "%W~rlbus:runA:worker:trainer:*" in args


@pytest.mark.parametrize("role", ["rollout", "reward", "serve"])
def test_heartbeat_roles_are_write_only_on_their_own_entries(role: str) -> None:
    args = setuser_args(role, "runA")
    assert patterns(args) == [f"rlbus:runA:worker:{role}:*", "rlbus:runA:workers"]
    assert all(a.startswith("%W~") for a in args if "~" in a)
    assert "+@read" not in args and "+@write" in args
    assert not any("once:" in a or "buf:" in a or "ctr:" in a for a in args)


def test_prompt_producer_reads_trainer_counters_and_writes_only_its_sequence() -> None:
    args = setuser_args("prompts", "runA")
    assert "~rlbus:runA:ctr:prompts:*" in args and "%R~rlbus:runA:ctr:trainer:*" in args
    assert "%R~rlbus:runA:worker:*" in args and "%W~rlbus:runA:worker:prompts:*" in args
    assert not any("once:" in a or "buf:" in a for a in args)


def test_a_custom_key_prefix_is_matched_literally() -> None:
    args = setuser_args("trainer", "runA", key_prefix="team[1]*:")
    assert r"~team\[1\]\*:once:*" in args


@pytest.mark.parametrize("namespace", ["once", "worker", "a:b", "-x", "x y"])
def test_namespaces_that_would_overlap_or_are_invalid_are_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        role_rules("trainer", namespace)


def test_unknown_roles_and_empty_prefixes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown role"):
        role_rules("admin", "runA")
    with pytest.raises(ValueError, match="empty key prefix"):
        role_rules("trainer", "runA", key_prefix="")


def test_role_urls_quote_the_password_and_drop_any_admin_credentials() -> None:
    password = "p@ss:/?#[]% wörd"
    url = role_url("redis://admin:secret@redis.internal:6380/2", "rlbus-runA-trainer", password)
    assert url.startswith("redis://rlbus-runA-trainer:") and url.endswith("@redis.internal:6380/2")
    assert "secret" not in url and password not in url
    from redis.asyncio.connection import parse_url  # what Redis.from_url uses

    parsed = parse_url(url)
    assert parsed["username"] == "rlbus-runA-trainer" and parsed["password"] == password
    assert parsed["host"] == "redis.internal" and parsed["port"] == 6380 and parsed["db"] == 2
    assert role_url("redis://[::1]:6379/0", "u") == "redis://u@[::1]:6379/0"
    assert redis_acl.redact_url(url) == "redis://rlbus-runA-trainer:***@redis.internal:6380/2"
    assert redis_acl.redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redis_acl.url_user(url) == "rlbus-runA-trainer" and redis_acl.url_user("redis://h/0") is None


def test_passwords_come_from_env_first_then_files_created_0600(tmp_path: Path) -> None:
    directory = tmp_path / "secrets"
    env = {"RLBUS_REDIS_PASSWORD_TRAINER": "from-env"}
    passwords, created = redis_acl.read_passwords(["trainer", "rollout"], directory=directory, environ=env)
    assert passwords["trainer"] == "from-env" and created == ["rollout"]
    path = directory / "rollout"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert len(passwords["rollout"]) >= 40 and path.read_text().strip() == passwords["rollout"]
    again, created = redis_acl.read_passwords(["rollout"], directory=directory, environ={})
    assert again == {"rollout": passwords["rollout"]} and created == []


def test_a_role_without_a_password_is_an_error_naming_where_to_put_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\$RLBUS_REDIS_PASSWORD_REWARD"):
        redis_acl.read_passwords(["reward"], environ={})
    with pytest.raises(ValueError, match="reward"):
        redis_acl.read_passwords(["reward"], directory=tmp_path / "none", environ={}, create=False)
    (tmp_path / "serve").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        redis_acl.read_passwords(["serve"], directory=tmp_path, environ={})


def test_the_password_hash_is_what_redis_stores() -> None:
    assert redis_acl.password_hash("foobar") == "c3ab8ff13720e8ad9047dd39466b3c8974e592c2fa383d4a3960714caef0c4f2"
