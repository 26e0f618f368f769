"""Scoped blob-store keys: one credential per role, minted from the blob server's master secret.

Why: with one shared HMAC secret, every process that reads weights could also overwrite the trainer's
chunks, delete a run or list every key, and a secret leaked from one inference machine in one region was
as good as the trainer's. Scoped keys give each role only what it needs (least privilege) without the
server keeping any state, and they expire on their own:

* **Least privilege.** A key's claims are a key id (named in the server's log on every refusal), its
  permissions — a subset of ``read`` (GET and HEAD), ``write`` (PUT), ``delete`` and ``list`` —, a key
  prefix it is confined to (``run7/``, or ``""`` for the whole store) and an expiry. A prefix always ends
  with ``/`` (``run7`` is stored as ``run7/``), so ``run7/`` never reaches ``run70/x``; a blob key with a
  ``.`` or ``..`` segment is refused outright, so ``run7/../run8/x`` cannot climb out of it.
* **Stateless.** The credential carries its claims and a secret derived from them,
  ``HMAC-SHA256(master, claims)`` (macaroon-style). The server re-derives that secret from its master and
  the claims the request carries, so minting needs no server, no database and no revocation list: change
  one byte of the claims and the derived secret is another one. Rotating the master secret revokes every
  key minted from it.
* **Expiring.** A key with an expiry stops working then, whoever still holds it.

The master secret itself keeps full access — the trainer and operators may go on using it, and nothing
configured before scoped keys existed changes.

Credential format (what ``rlbus blobs key`` prints and ``RLBUS_BLOB_SECRET`` may hold)::

    rbk1.<claims>.<derived>
      claims  = base64url, unpadded, of the canonical claims JSON: sorted keys, no spaces, permissions in
                the order read, write, delete, list, e.g.
                {"exp":1767225600,"id":"worker-3fa2c1","perm":["read"],"prefix":"run7/"}
                ("exp": null never expires)
      derived = hex HMAC-SHA256(master, "rbk1\\n" + claims JSON)

A client signs every request with ``derived`` exactly as a master holder signs with the master
(:func:`rlbus.blobs.http.sign`: ``METHOD\\nkey\\nexpires``) and sends ``<claims>`` as the ``claims`` query
parameter; ``derived`` itself never travels. Anything that begins ``rbk1.`` is read as a scoped key, so
a master secret must not.

Roles (:data:`ROLES`): the trainer writes versions and collects old ones (all four), a reward worker and
a regional relay's upstream client only read, an operator inspects and cleans up (read, list, delete). A
rollout worker (and the gateway) also write claim-checked payloads (:mod:`rlbus.bus.claimcheck`: MoE
routing over 512 KiB) under ``claims/`` and nowhere else: read everywhere, write under ``write_prefix``
(claim ``wprefix``, optional: keys without it verify as before).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rlbus.blobs.base import check_key
from rlbus.errors import ConfigError

#: What every scoped credential begins with; the version lets a later format live beside this one.
KEY_PREFIX = "rbk1."
#: The query parameter a scoped request carries its encoded claims in.
CLAIMS_PARAM = "claims"
#: Every permission, in canonical order.
PERMISSIONS: tuple[str, ...] = ("read", "write", "delete", "list")
#: Which permission each signed method needs; HEAD is signed as GET, so "read" covers both.
METHOD_PERMISSION = {"GET": "read", "HEAD": "read", "PUT": "write", "DELETE": "delete", "LIST": "list"}
#: The permission set of each role ``rlbus blobs key --role`` mints for.
ROLES: dict[str, frozenset[str]] = {
    "trainer": frozenset({"read", "write", "delete", "list"}),
    "worker": frozenset({"read"}),
    "rollout": frozenset({"read", "write"}),
    "relay": frozenset({"read"}),
    "operator": frozenset({"read", "list", "delete"}),
}

_DOMAIN = b"rbk1\n"  # separates derived secrets from request signatures made with the same master
_MAX_ENCODED = 2048  # a prefix is at most 512 characters; this also bounds what json.loads is given
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_TTL = re.compile(r"(\d+)\s*([smhdw]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def is_scoped(secret: str) -> bool:
    """Whether ``secret`` is a scoped-key credential (rather than a master secret)."""
    return secret.startswith(KEY_PREFIX)


def parse_ttl(text: str) -> int:
    """``3600``, ``3600s``, ``30m``, ``12h``, ``7d``, ``2w`` → seconds (> 0); ConfigError naming ``ttl``."""
    match = _TTL.fullmatch(text.strip().lower())
    if match is None:
        raise ConfigError("ttl", f"{text!r} is not a duration: a number with s, m, h, d or w (3600s, 7d)")
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds <= 0:
        raise ConfigError("ttl", f"{text!r}: a key's lifetime must be positive")
    return seconds


def role_permissions(role: str) -> frozenset[str]:
    """The permissions of a role in :data:`ROLES`; ConfigError naming ``role`` for any other name."""
    try:
        return ROLES[role]
    except KeyError:
        raise ConfigError("role", f"unknown role {role!r}; one of {', '.join(ROLES)}") from None


def parse_permissions(text: str | Iterable[str]) -> frozenset[str]:
    """``"read,list"`` (or an iterable of names) → a non-empty permission set; ConfigError naming
    ``permissions`` for an unknown name."""
    names = [p.strip().lower() for p in (text.split(",") if isinstance(text, str) else text)]
    names = [p for p in names if p]
    unknown = [p for p in names if p not in PERMISSIONS]
    if unknown:
        raise ConfigError("permissions", f"unknown permission {unknown[0]!r}; a subset of {', '.join(PERMISSIONS)}")
    if not names:
        raise ConfigError("permissions", f"no permission given; a subset of {', '.join(PERMISSIONS)}")
    return frozenset(names)


def normalise_prefix(prefix: str) -> str:
    """A scope prefix as claims hold it: ``""`` (everything) or a valid key path ending with ``/``.

    The trailing slash is what makes the scope a set of path segments rather than of strings:
    ``run7`` becomes ``run7/``, which covers ``run7/…`` and not ``run70/…``."""
    prefix = prefix.strip()
    if prefix == "":
        return ""
    body = prefix.rstrip("/")
    try:
        check_key(body)
    except ValueError:
        raise ConfigError("prefix", f"{prefix!r} is not a key prefix: slash-separated names of "
                                    "[A-Za-z0-9._-], no '.' or '..' segment, no leading '/'") from None
    return body + "/"


@dataclass(frozen=True)
class KeyClaims:
    """What a scoped key allows: who (``key_id``), what (``permissions``), where (``prefix``), until when
    (``expires``, a Unix time, or None for never)."""

    key_id: str
    permissions: frozenset[str]
    prefix: str = ""
    expires: int | None = None
    #: Where write and delete are confined, inside ``prefix`` (None: all of ``prefix``). A rollout worker
    #: reads weights anywhere but writes only its claim-checked payloads: ``write_prefix = "claims/"``.
    write_prefix: str | None = None

    def __post_init__(self) -> None:
        if not _KEY_ID.fullmatch(self.key_id):
            raise ConfigError("name", f"key id {self.key_id!r}: 1-64 characters of [A-Za-z0-9._-]")
        if not self.permissions or not self.permissions <= set(PERMISSIONS):
            raise ConfigError("permissions", f"a non-empty subset of {', '.join(PERMISSIONS)}")
        if normalise_prefix(self.prefix) != self.prefix:
            raise ConfigError("prefix", f"{self.prefix!r} must be '' or end with '/' (normalise_prefix)")
        if self.write_prefix is not None:
            if not self.write_prefix or normalise_prefix(self.write_prefix) != self.write_prefix:
                raise ConfigError("write_prefix", f"{self.write_prefix!r} must be non-empty and end with '/'")
            if not self.write_prefix.startswith(self.prefix):
                raise ConfigError("write_prefix", f"{self.write_prefix!r} is outside the prefix {self.prefix!r}")

    def canonical(self) -> bytes:
        """The one byte string these claims are signed as."""
        fields: dict[str, object] = {
            "exp": self.expires,
            "id": self.key_id,
            "perm": [p for p in PERMISSIONS if p in self.permissions],
            "prefix": self.prefix,
        }
        if self.write_prefix is not None:  # absent, not null: keys minted before it existed stay valid
            fields["wprefix"] = self.write_prefix
        return json.dumps(
            fields,
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    def encode(self) -> str:
        """The claims as they travel: unpadded base64url of :meth:`canonical`."""
        return base64.urlsafe_b64encode(self.canonical()).rstrip(b"=").decode()

    @classmethod
    def decode(cls, encoded: str) -> KeyClaims:
        """Claims back from :meth:`encode`; ValueError (never naming a secret) when they are not exactly
        a canonical encoding."""
        if len(encoded) > _MAX_ENCODED:
            raise ValueError(f"claims longer than {_MAX_ENCODED} characters")
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            data = json.loads(raw)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"claims are not base64url JSON ({type(exc).__name__})") from None
        if not isinstance(data, dict) or set(data) - {"wprefix"} != {"exp", "id", "perm", "prefix"}:
            raise ValueError("claims need exactly exp, id, perm and prefix (and maybe wprefix)")
        expires, key_id, perms, prefix = data["exp"], data["id"], data["perm"], data["prefix"]
        write_prefix = data.get("wprefix")
        if write_prefix is not None and not isinstance(write_prefix, str):
            raise ValueError("claim wprefix must be a string")
        if expires is not None and type(expires) is not int:
            raise ValueError("claim exp is not an integer or null")
        if not isinstance(key_id, str) or not isinstance(prefix, str):
            raise ValueError("claims id and prefix must be strings")
        if not isinstance(perms, list) or not all(isinstance(p, str) for p in perms):
            raise ValueError("claim perm is not a list of names")
        try:
            claims = cls(key_id, frozenset(perms), prefix, expires, write_prefix)
        except ConfigError as exc:
            raise ValueError(f"claim {exc.field}: {exc.problem}") from None
        if claims.canonical() != raw or claims.encode() != encoded:
            raise ValueError("claims are not in canonical form")
        return claims

    def refusal(self, method: str, blob_key: str, now: float | None = None) -> str | None:
        """Why this key may not do ``method`` (GET, HEAD, PUT, DELETE or LIST) on ``blob_key`` (the prefix
        for LIST), or None when it may. Texts name the permission, prefix or expiry, never a secret."""
        name = ascii(self.key_id)
        if self.expires is not None and (time.time() if now is None else now) >= self.expires:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires))
            return f"key {name} expired at {stamp}"
        needed = METHOD_PERMISSION.get(method.upper())
        if needed is None or needed not in self.permissions:
            held = ", ".join(p for p in PERMISSIONS if p in self.permissions)
            return f"key {name} lacks the {needed or method} permission (it holds: {held})"
        if method.upper() == "LIST":
            if not blob_key.startswith(self.prefix):
                return f"key {name} is scoped to prefix {self.prefix!r}; listing {blob_key!a} is outside it"
            return None
        try:
            check_key(blob_key)
        except ValueError:
            return f"key {name}: {blob_key!a} is not a valid blob key"
        if not blob_key.startswith(self.prefix):
            return f"key {name} is scoped to prefix {self.prefix!r}; {blob_key!a} is outside it"
        if needed in ("write", "delete") and self.write_prefix is not None and not blob_key.startswith(
            self.write_prefix
        ):
            return f"key {name} may {needed} only under {self.write_prefix!r}; {blob_key!a} is outside it"
        return None


def derive(master: str, claims: KeyClaims) -> str:
    """The secret a key with these claims signs with: hex HMAC-SHA256(master, "rbk1\\n" + claims)."""
    return hmac.new(master.encode(), _DOMAIN + claims.canonical(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ScopedKey:
    """A parsed credential: the claims and the derived secret the holder signs requests with."""

    claims: KeyClaims
    secret: str

    def __str__(self) -> str:
        return f"{KEY_PREFIX}{self.claims.encode()}.{self.secret}"

    def __repr__(self) -> str:  # never the derived secret, also not in a traceback's locals
        return f"ScopedKey({self.claims!r})"

    @classmethod
    def parse(cls, credential: str) -> ScopedKey:
        """``rbk1.<claims>.<derived>`` → ScopedKey; ValueError (never quoting the credential) otherwise."""
        if not is_scoped(credential):
            raise ValueError(f"a scoped key begins with {KEY_PREFIX!r}")
        encoded, dot, derived = credential.strip()[len(KEY_PREFIX):].partition(".")
        if not dot or not re.fullmatch(r"[0-9a-f]{64}", derived):
            raise ValueError("a scoped key is rbk1.<claims>.<64 hex digits>")
        return cls(KeyClaims.decode(encoded), derived)


def mint(master: str, claims: KeyClaims) -> str:
    """The credential for ``claims``, minted from the master secret."""
    if is_scoped(master):
        raise ConfigError("blobs.secret", "keys are minted from the master secret, not from a scoped key")
    return str(ScopedKey(claims, derive(master, claims)))


def mint_for_role(
    master: str,
    role: str,
    *,
    prefix: str = "",
    ttl: str | int | None = None,
    permissions: str | Iterable[str] | None = None,
    key_id: str | None = None,
    now: float | None = None,
    write_prefix: str | None = None,
) -> str:
    """A credential for ``role``: its permissions from :data:`ROLES` unless ``permissions`` replaces them,
    confined to ``prefix``, expiring ``ttl`` (seconds, or ``"7d"``-style) after ``now``, named ``key_id``
    (default ``<role>-<6 random hex>``)."""
    granted = role_permissions(role) if permissions is None else parse_permissions(permissions)
    expires = None
    if ttl is not None:
        seconds = parse_ttl(ttl) if isinstance(ttl, str) else ttl
        if seconds <= 0:
            raise ConfigError("ttl", f"{ttl!r}: a key's lifetime must be positive")
        expires = int((time.time() if now is None else now) + seconds)
    writes = None if write_prefix is None else normalise_prefix(write_prefix)
    claims = KeyClaims(key_id or f"{role}-{secrets.token_hex(3)}", granted, normalise_prefix(prefix), expires, writes)
    return mint(master, claims)


def verify_claims(master: str, encoded: str) -> tuple[KeyClaims, str]:
    """Server side: the claims a request carries and the secret its signature must be made with.

    The signature check that follows (:mod:`rlbus.blobs.http`) is what proves the claims were minted from
    ``master``: a holder who edits them gets a different derived secret than the one it signs with.
    ValueError when the claims do not even parse."""
    claims = KeyClaims.decode(encoded)
    return claims, derive(master, claims)


def fleet_keys(master: str, *, ttl: str | int | None) -> dict[str, str]:
    """Each worker role's credential in a secure fleet (``rlbus up --secure``, docker-compose.secure.yml): the
    trainer the master (it writes versions and collects old ones); rollout workers and the gateway (``serve``)
    read everywhere and write ``claims/`` only; the reward worker and the prompt producer read only."""
    writer = mint_for_role(master, "rollout", write_prefix="claims/", ttl=ttl)
    reader = mint_for_role(master, "worker", ttl=ttl)
    return {"trainer": master, "rollout": writer, "serve": writer, "reward": reader, "prompts": reader}
