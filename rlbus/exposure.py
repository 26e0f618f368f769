"""Who can reach rlbus's HTTP endpoints: a guard on the bind address and bearer-token authentication.

Nothing rlbus serves is reachable from another host without authentication. Each server calls
:func:`check_bind` before it binds: an address other than loopback (``127.0.0.0/8``, ``::1``,
``localhost``) without a configured token is a `ConfigError` naming the host setting and the fix. Only
address literals and the name ``localhost`` count as loopback: ``0.0.0.0``, ``::``, ``""`` (every
interface), a LAN address and any other name (it could resolve anywhere, and may resolve differently
later) are off-host. Nothing is resolved.

The services, the setting that picks each one's host, and its token:

* dashboard — ``rlbus dashboard --host`` — ``RLBUS_DASHBOARD_TOKEN`` / ``RLBUS_DASHBOARD_TOKEN_FILE``;
  every path needs it.
* metrics — ``run.metrics_host`` / ``$RLBUS_METRICS_HOST`` (`rlbus.metrics.serve_metrics`) —
  ``RLBUS_METRICS_TOKEN`` / ``RLBUS_METRICS_TOKEN_FILE``; ``/metrics`` needs it.
* feedback — ``rlbus feedback serve --host`` — ``RLBUS_FEEDBACK_TOKEN`` / ``RLBUS_FEEDBACK_TOKEN_FILE``,
  required even on loopback; ``/healthz`` is open.
* serve (the gateway) — ``serve.host`` / ``rlbus serve --host`` — tenant tokens, ``RLBUS_SERVE_TOKENS`` /
  ``RLBUS_SERVE_TOKEN_FILE`` (`rlbus.serve.auth`), required even on loopback; ``/healthz`` is open, and its
  ``/metrics`` takes the metrics token.

A configured token is enforced on loopback too. The gateway's ``/metrics`` and the details of its
``/healthz`` take the metrics token (and are open without one only on loopback). The open ``/healthz``
paths answer ``{"ok": true}`` and nothing else unless the request carries the service's token.

Tokens are read as `rlbus.config.secret_from` reads secrets (this module sits below ``config`` in the
layers, so it repeats the few lines): the file named by ``$RLBUS_<SERVICE>_TOKEN_FILE`` (surrounding
whitespace stripped; unreadable or empty is a ConfigError naming the file, never its contents), else
``$RLBUS_<SERVICE>_TOKEN``. A token shorter than 16 characters is a ConfigError. Never on a command line,
where ``ps`` shows it.

:class:`BearerAuth` is the aiohttp middleware: ``Authorization: Bearer <token>``, compared in constant time
(over SHA-256 digests, so not even the length leaks). The dashboard also takes HTTP Basic with the token as
the password, so a browser can sign in (its own prompt; the page's ``fetch`` calls then carry the header).
A refused request is a 401 with a JSON body and ``WWW-Authenticate``, logged at WARNING with the service,
method, path and peer address — never a token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.errors import ConfigError

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("rlbus.exposure")

MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Service:
    """One HTTP service rlbus runs: where its host is set and how it is authenticated."""

    name: str
    #: The setting that chose the host, named by the ConfigError.
    host_field: str
    #: The environment variable holding the token, and the one naming a file that holds it.
    token_env: str
    token_file_env: str
    #: How to configure authentication, for the error message.
    fix: str

    @property
    def token_field(self) -> str:
        return f"{self.name}.token"


def _fix(token_env: str, token_file_env: str) -> str:
    return f"set {token_env} (or {token_file_env}, a file holding it; at least {MIN_TOKEN_CHARS} characters)"


SERVICES: dict[str, Service] = {
    "dashboard": Service("dashboard", "dashboard.host", "RLBUS_DASHBOARD_TOKEN", "RLBUS_DASHBOARD_TOKEN_FILE",
                         _fix("RLBUS_DASHBOARD_TOKEN", "RLBUS_DASHBOARD_TOKEN_FILE")),
    "metrics": Service("metrics", "run.metrics_host", "RLBUS_METRICS_TOKEN", "RLBUS_METRICS_TOKEN_FILE",
                       _fix("RLBUS_METRICS_TOKEN", "RLBUS_METRICS_TOKEN_FILE")
                       + " and give Prometheus the same token (authorization: credentials_file)"),
    "feedback": Service("feedback", "feedback.host", "RLBUS_FEEDBACK_TOKEN", "RLBUS_FEEDBACK_TOKEN_FILE",
                        _fix("RLBUS_FEEDBACK_TOKEN", "RLBUS_FEEDBACK_TOKEN_FILE")),
    "serve": Service("serve", "serve.host", "RLBUS_SERVE_TOKENS", "RLBUS_SERVE_TOKEN_FILE",
                     "set RLBUS_SERVE_TOKENS='tenant:token,…' or give a token file (--token-file, "
                     "RLBUS_SERVE_TOKEN_FILE: one 'tenant: token' per line)"),
}


def _service(name: str) -> Service:
    try:
        return SERVICES[name]
    except KeyError:
        raise ValueError(f"unknown service {name!r}; known: {', '.join(SERVICES)}") from None


# --- the bind guard --------------------------------------------------------------------------------
def is_loopback(host: str | None) -> bool:
    """True only for a loopback address literal (127.0.0.0/8, ::1, ::ffff:127.x.y.z, ``[::1]``) or the
    name ``localhost``. None and ``""`` (every interface), ``0.0.0.0``, ``::``, other addresses and any
    other name are False: a name is never resolved here."""
    if not host:
        return False
    if host.lower().removesuffix(".") == "localhost":
        return True
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        return False  # a name (or a shorthand like 127.1 that only getaddrinfo reads): off-host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _where(host: str | None) -> str:
    if not host:
        return "every interface"
    if host in ("0.0.0.0", "::"):
        return f"{host} (every interface)"
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"{host} (a name, which may resolve to any interface; only 'localhost' counts as loopback)"
    return f"{host} (not a loopback address)"


def check_bind(host: str | None, *, service: str, auth_configured: bool, field: str | None = None) -> None:
    """Refuse to serve ``service`` off-host without authentication: a ConfigError naming ``field`` (default:
    the service's host setting) that says how to configure a token, or to bind 127.0.0.1."""
    spec = _service(service)
    if auth_configured or is_loopback(host):
        return
    raise ConfigError(
        field or spec.host_field,
        f"the {spec.name} endpoint would listen on {_where(host)} without authentication, so any host "
        f"that reaches it could read it: {spec.fix}, or bind 127.0.0.1",
    )


# --- tokens ------------------------------------------------------------------------------------------
def load_token(name: str, *, file: str | Path | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The service's token: ``file`` (or the file ``$RLBUS_<SERVICE>_TOKEN_FILE`` names), else
    ``$RLBUS_<SERVICE>_TOKEN``; None when neither is set. Unreadable or empty files and tokens shorter than
    16 characters are ConfigErrors naming ``<service>.token``."""
    spec = _service(name)
    if name == "serve":
        raise ValueError("the gateway's tenant tokens are loaded by rlbus.serve.auth.load_tenants")
    if file is None and environ.get(spec.token_file_env):
        file = environ[spec.token_file_env]
    if file is not None:
        try:
            token = Path(file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(spec.token_field, f"cannot read token file {file}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(spec.token_field, f"token file {file} is empty")
    else:
        token = (environ.get(spec.token_env) or "").strip()
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(spec.token_field, f"the token must be at least {MIN_TOKEN_CHARS} characters")
    return token


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


class BearerAuth:
    """The aiohttp middleware of one service: every path but ``open_paths`` needs the token. ``browser``
    also accepts HTTP Basic with the token as password (any user name) and asks browsers to prompt."""

    def __init__(self, name: str, token: str, *, open_paths: Collection[str] = (), browser: bool = False) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(_service(name).token_field, f"the token must be at least {MIN_TOKEN_CHARS} characters")
        self.service = _service(name)
        self._digest = _digest(token.encode())
        self.open_paths = frozenset(open_paths)
        self.browser = browser
        self.refused = 0

    def _why_not(self, authorization: str | None) -> str | None:
        """None when ``authorization`` carries the token, else why not (for the log; never the token)."""
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        credentials = credentials.strip()
        if scheme.lower() == "bearer" and credentials:
            given = credentials.encode()
        elif self.browser and scheme.lower() == "basic" and credentials:
            try:
                _, _, password = base64.b64decode(credentials, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return "malformed basic credentials"
            given = password.encode()
        elif not authorization:
            return "no credentials"
        else:
            return "unsupported authorization scheme"
        return None if hmac.compare_digest(_digest(given), self._digest) else "wrong token"

    def accepts(self, request: web.Request) -> bool:
        """Whether ``request`` carries the token (for an open path that shows more to the authenticated)."""
        return self._why_not(request.headers.get("Authorization")) is None

    def challenge(self) -> list[tuple[str, str]]:
        """``WWW-Authenticate`` headers: Bearer, and Basic first for a browser (it prompts for Basic only)."""
        realm = f'realm="rlbus-{self.service.name}"'
        bearer = [("WWW-Authenticate", f"Bearer {realm}")]
        return [("WWW-Authenticate", f'Basic {realm}, charset="UTF-8"'), *bearer] if self.browser else bearer

    def refuse(self, request: web.Request, why: str) -> web.Response:
        from aiohttp import web
        from multidict import CIMultiDict

        self.refused += 1
        log.warning("%s: refused %s %r from %s: %s", self.service.name, request.method, request.path,
                    request.remote or "unknown peer", why)
        body = {"error": f"authentication required: send 'Authorization: Bearer <token>' "
                         f"(the {self.service.token_env} token)"}
        return web.json_response(body, status=401, headers=CIMultiDict(self.challenge()))

    @property
    def middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path not in self.open_paths:
                why = self._why_not(request.headers.get("Authorization"))
                if why is not None:
                    return self.refuse(request, why)
            return await handler(request)

        return authenticate
