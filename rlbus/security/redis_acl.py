"""Redis ACL users, one per role of a run: least privilege on the shared state store.

Why. Without users, any process holding the Redis URL reads and writes every key and runs every command: a
rollout worker (which runs model-generated code beside it) could mark rollouts as trained in the
trainer's exactly-once ledger, reset the prompt sequence, read another run's join buffer or FLUSHALL.
Each role gets its own user that can touch only the keys that role's code uses, under its run's key
prefix, and only the commands that code sends; the ``operator`` alone keeps every command.

Keys are namespaced. Every state key starts with the run's key prefix (`rlbus.launch.config.RunConfig.
state_prefix`): ``rlbus:<namespace>:`` for a run with ``run.namespace``, ``rlbus:`` without one, or
``state.key_prefix`` when the config sets it (pass it as ``key_prefix``). Under the prefix P
(`rlbus.state.redis`)::

    P once:<ns>:<id>    trainer's idempotency ledger      P ctr:<name>     counters (`rlbus.state.progress`)
    P buf:<key>         trainer's join buffer (hashes)    P worker:<role>:<id>, P workers   worker registry

Roles (the registry names of `rlbus.launch.roles.ROLES`, plus two for people) and what they may do:

    trainer   read/write the ledger, the buffer and its counters (ctr:trainer:*, outcome:*, join:*, ledger:*);
              runs the ledger's and the join's Lua scripts (EVALSHA, SCRIPT LOAD); writes its heartbeat
    prompts   read/write ctr:prompts:* (the prompt sequence); read ctr:trainer:* and the registry (admission);
              writes its heartbeat and prunes expired entries from the index
    rollout, reward, serve
              write-only: their own heartbeat (worker:<role>:*) and the registry index
    observer  ``rlbus status``, the dashboard: read counters and the registry, prune the index
    operator  every command (``+@all``) on every key kind under the prefix: administration, cleanup

Non-operators get ``+@read``/``+@write`` (the write-only roles no ``+@read``), ``+@transaction`` (redis-py
pipelines are MULTI/EXEC) and ``+@connection``, then lose ``-@scripting -@admin -@dangerous`` (so no CONFIG,
FLUSHALL, ACL, KEYS, FUNCTION FLUSH …, and no CLIENT KILL that ``@connection`` would bring) and the keyless
SCAN and RANDOMKEY, which would list other runs' key names. No role uses pub/sub: channels are reset.

Redis features: ACL users (6.0), read/write key permissions ``%R~`` / ``%W~`` and subcommand rules such as
``+script|load`` (7.0), and the atomic ``ACL SETUSER`` of 7.0 (a failed update leaves the user as it was).
Each role needs one set of permissions, so its root selector is enough and no ``(…)`` selectors are used.
Checked against the Debian ``redis-server`` 7.0.15. Users are created with redis-py's ``acl_setuser``
with ``reset`` first, so applying them again (rotating a password, changing a rule) replaces everything;
passwords go to Redis as SHA-256 hashes (``#<hex>``, ``hashed_passwords``), so the plain text is never
on the wire and never in a server error, a log line or an exception of this module.

The ``default`` user. Redis starts with a passwordless ``default`` user that may do everything; it is what
`rlbus_tools.services.redis.start_redis`, ``infra/redis/redis.conf`` and the tests use. A production deployment
turns it off once the role users exist (``disable_default=True``, ``rlbus redis users --disable-default``):
until then anyone who reaches the port bypasses every rule here. `apply_users` refuses to turn it off from a
connection that is itself ``default`` unless the same call creates the ``operator``, who can still
administer the server afterwards (the connection doing it keeps working until it closes).

Limits. ACLs are per server, not per database: ``/db`` in a URL separates nothing. A run without a namespace
(prefix ``rlbus:``) and a run whose namespace is a key kind (``once``, ``buf``, ``ctr``, ``worker``) would
overlap, so those namespaces are refused here. Usernames are ``rlbus-<namespace>-<role>`` (``rlbus-<role>``
without a namespace): two runs sharing one Redis need distinct namespaces. The operator's ``+@all`` includes
ACL and FLUSHALL, which act on the whole server, whatever its key patterns.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rlbus.errors import StateError

log = logging.getLogger("rlbus.security.redis_acl")

#: Every role a run's Redis has a user for, in the order they are created.
ROLES: tuple[str, ...] = ("trainer", "prompts", "rollout", "reward", "serve", "observer", "operator")
#: Namespaces that would make a run's keys match another run's patterns (``rlbus:once:…`` is both the ledger
#: of a run without a namespace and every key of the namespace ``once``).
RESERVED_NAMESPACES = frozenset({"once", "buf", "ctr", "worker", "workers"})
#: A run namespace, as `rlbus.launch.config.RunSection` accepts it.
NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,98}")
#: Environment variable holding a role's password: ``RLBUS_REDIS_PASSWORD_TRAINER`` …
PASSWORD_ENV = "RLBUS_REDIS_PASSWORD_{ROLE}"

Access = Literal["R", "W", "RW"]

#: Categories every non-operator role ends with: no scripting (FUNCTION FLUSH is in @write), no admin or
#: dangerous command (CONFIG, FLUSHALL, ACL, KEYS, DEBUG, CLIENT KILL from @connection …).
_DENIED = ("-@scripting", "-@admin", "-@dangerous")
#: Keyless commands that list key names of every run on the server.
_NO_ENUMERATION = ("-scan", "-randomkey")
_READ_WRITE = ("+@read", "+@write", "+@transaction", "+@connection", *_DENIED)
_WRITE_ONLY = ("+@write", "+@transaction", "+@connection", *_DENIED)
#: What the trainer's store runs as scripts: redis-py's Script sends EVALSHA and, on NOSCRIPT, SCRIPT LOAD.
_SCRIPTS = ("+evalsha", "+script|load")


@dataclass(frozen=True)
class KeyRule:
    """Keys under the run's prefix matching ``pattern`` (a glob relative to the prefix), with ``access``."""

    access: Access
    pattern: str

    def render(self, prefix: str) -> str:
        glob = escape_glob(prefix) + self.pattern
        return f"~{glob}" if self.access == "RW" else f"%{self.access}~{glob}"


@dataclass(frozen=True)
class RoleSpec:
    """What one role may do, independent of the namespace."""

    role: str
    summary: str
    categories: tuple[str, ...]
    commands: tuple[str, ...]
    keys: tuple[KeyRule, ...]


def _heartbeat(role: str) -> tuple[KeyRule, ...]:
    """A worker's registry entry (SET … PX) and the index it adds itself to (SADD), write-only."""
    return KeyRule("W", f"worker:{role}:*"), KeyRule("W", "workers")


#: The rules of every role (see the module docstring): the single place they are written down.
SPECS: dict[str, RoleSpec] = {
    spec.role: spec
    for spec in (
        RoleSpec(
            "trainer", "ledger, join buffer and the trainer's counters; the join's scripts",
            _READ_WRITE, (*_SCRIPTS, *_NO_ENUMERATION),
            (KeyRule("RW", "once:*"), KeyRule("RW", "buf:*"), KeyRule("RW", "ctr:trainer:*"),
             KeyRule("RW", "ctr:outcome:*"), KeyRule("RW", "ctr:join:*"), KeyRule("RW", "ctr:ledger:*"),
             *_heartbeat("trainer")),
        ),
        RoleSpec(
            "prompts", "the prompt sequence; reads the trainer's counters and the registry (admission)",
            _READ_WRITE, _NO_ENUMERATION,
            (KeyRule("RW", "ctr:prompts:*"), KeyRule("R", "ctr:trainer:*"), KeyRule("R", "worker:*"),
             KeyRule("W", "worker:prompts:*"), KeyRule("RW", "workers")),
        ),
        RoleSpec("rollout", "its heartbeat only (write-only)", _WRITE_ONLY, (), _heartbeat("rollout")),
        RoleSpec("reward", "its heartbeat only (write-only)", _WRITE_ONLY, (), _heartbeat("reward")),
        RoleSpec("serve", "its heartbeat only (write-only)", _WRITE_ONLY, (), _heartbeat("serve")),
        RoleSpec(
            "observer", "reads counters and the registry (rlbus status, the dashboard)",
            _READ_WRITE, _NO_ENUMERATION,
            (KeyRule("R", "ctr:*"), KeyRule("R", "worker:*"), KeyRule("RW", "workers")),
        ),
        RoleSpec(
            "operator", "every command on every key of the run (administration)",
            ("+@all",), (),
            tuple(KeyRule("RW", p) for p in ("once:*", "buf:*", "ctr:*", "worker:*", "workers")),
        ),
    )
}


@dataclass(frozen=True)
class RoleRules:
    """A role's user in one namespace: its name and the rules ``ACL SETUSER`` gets (passwords aside)."""

    role: str
    username: str
    categories: tuple[str, ...]
    commands: tuple[str, ...]
    keys: tuple[str, ...]

    def args(self) -> list[str]:
        """The ``ACL SETUSER <username>`` arguments without the password, in the order `apply_users` sends
        them: reset everything, no channels, enabled, then categories, commands and key patterns."""
        return ["reset", "resetchannels", "on", *self.categories, *self.commands, *self.keys]

    def __str__(self) -> str:
        return f"ACL SETUSER {self.username} {' '.join(self.args())}"


def escape_glob(text: str) -> str:
    """``text`` matched literally by a Redis glob (``*?[]\\`` escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def check_namespace(namespace: str) -> str:
    """``namespace`` when a run may use it with ACL users ("" is a run without one); ValueError otherwise."""
    if namespace and not NAMESPACE.fullmatch(namespace):
        raise ValueError(f"namespace {namespace!r} must be [A-Za-z0-9][A-Za-z0-9._-]* (≤ 99 chars)")
    if namespace in RESERVED_NAMESPACES:
        raise ValueError(f"namespace {namespace!r} is a key kind: its keys would match the patterns of a run "
                         f"without a namespace; choose another (not one of {', '.join(sorted(RESERVED_NAMESPACES))})")
    return namespace


def key_prefix_for(namespace: str = "") -> str:
    """The run's key prefix, as `rlbus.launch.config.RunConfig.state_prefix` derives it."""
    return f"rlbus:{namespace}:" if namespace else "rlbus:"


def username(role: str, namespace: str = "") -> str:
    """``rlbus-<namespace>-<role>``, or ``rlbus-<role>`` without a namespace."""
    check_role(role)
    return f"rlbus-{check_namespace(namespace)}-{role}" if namespace else f"rlbus-{role}"


def check_role(role: str) -> str:
    if role not in SPECS:
        raise ValueError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
    return role


def role_rules(role: str, namespace: str = "", *, key_prefix: str | None = None) -> RoleRules:
    """The rules of ``role`` for the run ``namespace`` (keys under ``key_prefix``, default the namespace's)."""
    spec = SPECS[check_role(role)]
    prefix = key_prefix if key_prefix is not None else key_prefix_for(check_namespace(namespace))
    if not prefix:
        raise ValueError("an empty key prefix would give the users every key of the server")
    return RoleRules(role=role, username=username(role, namespace), categories=spec.categories,
                     commands=spec.commands, keys=tuple(rule.render(prefix) for rule in spec.keys))


def setuser_args(role: str, namespace: str = "", *, key_prefix: str | None = None) -> list[str]:
    """The ``ACL SETUSER <user>`` arguments of ``role`` in ``namespace``, without the password."""
    return role_rules(role, namespace, key_prefix=key_prefix).args()


# --- URLs ------------------------------------------------------------------------------------------------
def role_url(url: str, user: str, password: str | None = None) -> str:
    """``url`` (``redis://[…@]host:port/db``, ``rediss://``, ``unix://``) connecting as ``user`` with
    ``password`` (URL-quoted, so any character is fine); without ``password`` a URL safe to print."""
    parts = urlsplit(url)
    hostport = parts.netloc.rpartition("@")[2]
    userinfo = quote(user, safe="") + (f":{quote(password, safe='')}" if password is not None else "")
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{hostport}"))


def redact_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    if not colon:
        return url
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


def url_user(url: str) -> str | None:
    """The username a URL connects as (None: ``default``)."""
    userinfo, at, _ = urlsplit(url).netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else ""
    return unquote(user) or None


# --- users -----------------------------------------------------------------------------------------------
def password_hash(password: str) -> str:
    """The SHA-256 hex digest Redis stores for ``password`` (what ``#<hash>`` sets)."""
    return hashlib.sha256(password.encode()).hexdigest()


def _scrub(message: str, secrets_: Iterable[str]) -> str:
    for secret in secrets_:
        if secret:
            message = message.replace(secret, "***")
    return message


async def apply_users(
    admin_url: str, users: Mapping[str, str], *, namespace: str = "", key_prefix: str | None = None,
    disable_default: bool = False,
) -> dict[str, str]:
    """Create or update the user of each role in ``users`` (role → password) for the run ``namespace``,
    through ``admin_url`` (a connection allowed ``ACL SETUSER``). Each user is reset first, so a second
    call with the same arguments changes nothing and one with a new password replaces the old one.

    With ``disable_default`` the ``default`` user is turned off afterwards — what a production deployment
    does; otherwise it is left as configured (tests and local runs use it). Returns role → username.
    Raises ValueError for an unknown role, an empty password or a namespace that cannot be used, and
    StateError when Redis refuses; no message names a password."""
    rules = [role_rules(role, namespace, key_prefix=key_prefix) for role in users]
    if any(not password for password in users.values()):
        raise ValueError(f"empty password for role(s) {', '.join(r for r, p in users.items() if not p)}")
    hidden = [s for p in users.values() for s in (p, password_hash(p))]
    where = redact_url(admin_url)
    client = Redis.from_url(admin_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        if disable_default and "operator" not in users:
            whoami = await client.acl_whoami()
            if (whoami.decode() if isinstance(whoami, bytes) else whoami) == "default":
                raise ValueError("turning the default user off from a connection that is default would leave no "
                                 "administrator: create the operator in the same call or connect as another admin")
        for rule in rules:
            await client.acl_setuser(
                rule.username, enabled=True, reset=True, reset_channels=True,
                hashed_passwords=[f"+{password_hash(users[rule.role])}"],
                categories=list(rule.categories), commands=list(rule.commands), keys=list(rule.keys),
            )
            log.info("redis user %s (%s) set: %s", rule.username, rule.role, " ".join(rule.args()))
        if disable_default:
            await client.acl_setuser("default", enabled=False)
            log.info("redis default user turned off at %s", where)
    except RedisError as exc:
        raise StateError(f"setting Redis ACL users at {where} failed: {_scrub(str(exc), hidden)}") from None
    finally:
        await client.aclose()
    return {rule.role: rule.username for rule in rules}


async def delete_users(admin_url: str, roles: Sequence[str] = ROLES, *, namespace: str = "") -> int:
    """Delete the users of ``roles`` in ``namespace`` (absent ones are fine); returns how many existed."""
    names = [username(role, namespace) for role in roles]
    client = Redis.from_url(admin_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        return int(await client.acl_deluser(*names)) if names else 0
    except RedisError as exc:
        raise StateError(f"deleting Redis ACL users at {redact_url(admin_url)} failed: {exc}") from None
    finally:
        await client.aclose()


# --- passwords -------------------------------------------------------------------------------------------
def generate_password() -> str:
    """A fresh random password (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def password_env(role: str) -> str:
    return PASSWORD_ENV.format(ROLE=check_role(role).upper())


def read_passwords(
    roles: Sequence[str] = ROLES, *, directory: Path | None = None, environ: Mapping[str, str] | None = None,
    create: bool = True,
) -> tuple[dict[str, str], list[str]]:
    """Each role's password: ``$RLBUS_REDIS_PASSWORD_<ROLE>`` when set, else the file ``directory/<role>``
    (one line; created with a fresh random password, mode 0600, when missing and ``create``). Returns the
    passwords and the roles whose file was created. ValueError when a role has neither."""
    env = os.environ if environ is None else environ
    passwords: dict[str, str] = {}
    created: list[str] = []
    missing: list[str] = []
    for role in roles:
        from_env = env.get(password_env(role), "")
        if from_env:
            passwords[role] = from_env
        elif directory is None:
            missing.append(role)
        else:
            path = directory / role
            if not path.exists() and create:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                _write_secret(path, generate_password())
                created.append(role)
            if not path.exists():
                missing.append(role)
                continue
            passwords[role] = _read_secret(path)
    if missing:
        names = ", ".join(f"${password_env(r)}" for r in missing)
        raise ValueError(f"no password for {', '.join(missing)}: set {names}"
                         + (" or give a directory of password files" if directory is None
                            else f" or create the files in {directory}"))
    return passwords, created


def _write_secret(path: Path, secret: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")


def _read_secret(path: Path) -> str:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by others (mode %03o): chmod 600 it", path, stat.S_IMODE(mode))
    secret = path.read_text().strip()
    if not secret:
        raise ValueError(f"{path} is empty: it must hold the role's password")
    return secret
