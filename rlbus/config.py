"""Configuration as data: frozen msgspec structs that reject unknown fields, and their builders.

A bad config fails at start with the field named (``ConfigError("bus.linger_ms", ...)``). ``kind``
picks the pluggable part; builders turn config into constructor arguments so classes never read config.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlbus.bus.base import Bus
from rlbus.errors import ConfigError


class KafkaBusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="kafka",
                     tag_field="kind"):
    """The bus over an Apache Kafka cluster."""

    #: Comma-separated ``host:port`` list of brokers.
    bootstrap: str = "127.0.0.1:9092"
    #: Client id prefix; the region is appended so broker logs and quotas tell regions apart.
    client_id: str = "rlbus"
    #: Region / availability zone (``client.rack``) for follower fetching.
    region: str | None = None
    #: Kafka-level compression of produced batches.
    compression: Literal["zstd", "lz4", "gzip", "snappy"] | None = "zstd"
    #: How long the producer waits to fill a batch.
    linger_ms: int = 5
    #: ``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``.
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    #: ``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512`` when SASL is used.
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    #: SASL user; ``$RLBUS_SASL_USERNAME`` when unset.
    sasl_username: str | None = None
    #: SASL password. Prefer ``sasl_password_file`` or ``$RLBUS_SASL_PASSWORD``: a config file is
    #: often committed or copied around. Never shown by repr.
    sasl_password: str | None = None
    #: A file holding the SASL password (e.g. a mounted secret); trailing newline ignored.
    sasl_password_file: str | None = None
    #: CA bundle (PEM) the brokers' certificates are checked against, for TLS.
    ssl_cafile: str | None = None
    #: Client certificate (PEM), when the brokers require one (mutual TLS).
    ssl_certfile: str | None = None
    #: Private key of ``ssl_certfile``.
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if self.linger_ms < 0:
            raise ValueError("linger_ms must be ≥ 0")
        if not re.fullmatch(r"[^,\s]+:\d+(,[^,\s]+:\d+)*", self.bootstrap):
            raise ValueError(f"bootstrap {self.bootstrap!r} is not a host:port[,host:port…] list")
        if self.sasl_mechanism and not self.security_protocol.startswith("SASL"):
            raise ValueError("sasl_mechanism needs security_protocol SASL_PLAINTEXT or SASL_SSL")
        if self.sasl_password is not None and self.sasl_password_file is not None:
            raise ValueError("sasl_password and sasl_password_file are exclusive: give one")

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return [(name, _masked(name, getattr(self, name))) for name in self.__struct_fields__]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self.__rich_repr__())
        return f"{type(self).__name__}({fields})"


class MemoryBusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="memory",
                      tag_field="kind"):
    """The embedded in-process bus (demo, tests)."""


BusConfig = KafkaBusConfig | MemoryBusConfig

SECRET_MASK = "***"


def _masked(name: str, value: Any) -> Any:
    """Secrets never reach a repr, a log line or a traceback's locals display."""
    return SECRET_MASK if value is not None and name in ("sasl_password",) else value


def secret_from(
    value: str | None,
    file: str | Path | None,
    env: str,
    *,
    field: str,
    file_env: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """A secret from, in order: the value given, the file named (or named by ``$file_env``), the
    environment variable ``env``; None when none is set.

    Secrets come from files or the environment so they never sit on a command line (visible to
    every local user in ``ps``) or in a config file that gets copied around. Whitespace around a file's
    contents (the newline ``echo`` adds, an editor's) is not part of the secret. A named file that cannot
    be read, or is empty, is a ConfigError naming ``field`` (and the file, never its contents).
    """
    if value:
        return value
    if file is None and file_env is not None and environ.get(file_env):
        file = environ[file_env]
    if file is not None:
        try:
            text = Path(file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(field, f"cannot read secret file {file}: {exc.strerror or exc}") from None
        if not text:
            raise ConfigError(field, f"secret file {file} is empty")
        return text
    return environ.get(env) or None


def parse(config_type: Any, data: Any, *, prefix: str) -> Any:
    """Validate ``data`` into ``config_type``; errors become ConfigError naming ``prefix.field``."""
    try:
        return msgspec.convert(data, config_type)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = re.search(r"at `\$\.?([^`]*)`", text)
        path = match.group(1) if match else ""
        # __post_init__ checks start their message with the field name; the error is at the struct they check
        first = re.match(r"(\w+)\b", text)
        if first and first.group(1) in getattr(_struct_at(config_type, path), "__struct_fields__", ()):
            path = ".".join(p for p in (path, first.group(1)) if p)
        field = ".".join(p for p in (prefix, path) if p)
        problem = re.sub(r"\s*- at `[^`]*`", "", text)
        if "Object contains unknown field" in text:
            unknown = re.search(r"unknown field `([^`]*)`", text)
            if unknown:
                field = ".".join(p for p in (field, unknown.group(1)) if p)
                known = getattr(_struct_at(config_type, path), "__struct_fields__", ())
                problem = f"unknown field `{unknown.group(1)}`{did_you_mean(unknown.group(1), known)}"
        raise ConfigError(field or prefix, problem) from None


def is_import_path(name: str) -> bool:
    """Whether ``name`` is a ``module:attr`` import path (``mypkg.tasks:WordProblems``) rather than a name."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def import_object(path: str, *, field: str) -> Any:
    """The object a ``module:attr`` import path names (``attr`` may be dotted: ``mod:Class.method``).

    A user's plugins (an environment, a reward function) are named this way in the run config; every process
    resolves the path itself, so the package must be importable there: installed in the environment the
    process runs in, or on ``PYTHONPATH``. Errors are ConfigErrors naming ``field`` and what failed."""
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr):
        raise ConfigError(field, f"{path!r} is not an import path of the form 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise ConfigError(field, f"cannot import module {module_name!r} (no module named {missing!r}): install "
                          f"its package in this Python environment (pip install …) or add its directory to "
                          f"PYTHONPATH") from None
    except Exception as exc:  # the user's module raised while it was imported
        raise ConfigError(field, f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(field, f"module {module_name!r} has no attribute {attr!r}"
                              f"{did_you_mean(part, dir(obj))}") from None
    return obj


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean `x`?"`` with the choice closest to a misspelt ``name``, or "" when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _struct_at(config_type: Any, path: str) -> Any:
    """The type of the field ``path`` (``grpo``, ``train.lr``, or an entry of a list of tables such as
    ``region[1]``) inside the struct ``config_type``; None when the path leaves the structs."""
    for part in filter(None, path.split(".")):
        match = re.fullmatch(r"(\w+)((?:\[\d+\])*)", part)
        if match is None or not (isinstance(config_type, type) and issubclass(config_type, msgspec.Struct)):
            return None
        name, indexes = match.groups()
        config_type = next((f.type for f in msgspec.structs.fields(config_type) if f.name == name), None)
        for _ in range(indexes.count("[")):  # list[T] → T
            args = typing.get_args(config_type)
            config_type = args[0] if typing.get_origin(config_type) in (list, tuple) and args else None
    return config_type


def build_bus(config: BusConfig) -> Bus:
    """Turn a bus config into a bus (not started)."""
    if isinstance(config, MemoryBusConfig):
        from rlbus.bus.memory import MemoryBus

        return MemoryBus()
    from rlbus.bus.kafka import KafkaBus, KafkaSettings

    password = secret_from(
        config.sasl_password, config.sasl_password_file, "RLBUS_SASL_PASSWORD", field="bus.sasl_password"
    )
    username = config.sasl_username or os.environ.get("RLBUS_SASL_USERNAME") or None
    if config.sasl_mechanism and not (username and password):
        raise ConfigError(
            "bus.sasl_password" if username else "bus.sasl_username",
            f"{config.sasl_mechanism} needs a username (sasl_username or $RLBUS_SASL_USERNAME) and a password "
            "(sasl_password_file or $RLBUS_SASL_PASSWORD)",
        )
    return KafkaBus(
        KafkaSettings(
            bootstrap=config.bootstrap,
            client_id=f"{config.client_id}-{config.region}" if config.region else config.client_id,
            client_rack=config.region,
            compression=config.compression,
            linger_ms=config.linger_ms,
            security_protocol=config.security_protocol,
            sasl_mechanism=config.sasl_mechanism,
            sasl_username=username,
            sasl_password=password,
            ssl_cafile=config.ssl_cafile,
            ssl_certfile=config.ssl_certfile,
            ssl_keyfile=config.ssl_keyfile,
        )
    )


def rlbus_home() -> Path:
    """``$RLBUS_HOME`` or ``~/.cache/rlbus`` (shared with the Kafka jar cache)."""
    return Path(os.environ.get("RLBUS_HOME") or Path.home() / ".cache" / "rlbus").expanduser()
