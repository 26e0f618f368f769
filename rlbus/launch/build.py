"""Builders: the run config → a bus, a state store, a blob store, a policy shape (STYLE 3).

Classes never read the run config; the role mains call these and pass plain objects on. Heavy imports
(torch) stay inside the one builder that needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from rlbus.bus.base import Bus
from rlbus.config import build_bus
from rlbus.launch.config import RunConfig, blob_secret
from rlbus.launch.namespace import namespaced
from rlbus.state import StateStore, open_state_store
from rlbus.weights.store import BlobStore, LocalStore

if TYPE_CHECKING:
    from rlbus.models.policy import Policy, PolicyConfig


def bus_for(config: RunConfig, *, region: str | None = None, client_id: str | None = None) -> Bus:
    """The run's bus (not started): Kafka with ``region`` as client-id suffix and ``client.rack``, under
    the run's namespace."""
    settings = config.bus
    if region is not None:
        settings = msgspec.structs.replace(settings, region=region)
    if client_id is not None:
        settings = msgspec.structs.replace(settings, client_id=client_id)
    return namespaced(build_bus(settings), config.topic_prefix)


def state_for(config: RunConfig) -> StateStore:
    return open_state_store(config.state.url, key_prefix=config.state_prefix)


def store_for(config: RunConfig, environ: Mapping[str, str] | None = None) -> tuple[BlobStore, str]:
    """The blob store and how manifests name it (its URL, or the directory)."""
    if config.store.url is not None:
        from rlbus.weights.http_store import HttpStore

        return HttpStore(config.store.url, secret=blob_secret(config.store, environ)), config.store.url
    directory = config.store_dir()
    return LocalStore(directory), str(directory)


def policy_config(config: RunConfig) -> PolicyConfig:
    """The policy's shape: the checkpoint's when ``model.checkpoint`` is set, else the ``[model]`` fields."""
    from rlbus.models.policy import PolicyConfig

    if config.model.checkpoint is None:
        return PolicyConfig(**config.model.shape())
    return initial_policy(config).config


def initial_policy(config: RunConfig) -> Policy:
    """The weights of ``model.checkpoint`` (shape included)."""
    from pathlib import Path

    from rlbus.errors import ConfigError
    from rlbus.training.checkpoint import load_checkpoint, policy_from_state

    assert config.model.checkpoint is not None
    path = Path(config.model.checkpoint)
    try:
        state = load_checkpoint(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.checkpoint", f"cannot read {path}: {exc}") from None
    if state is None:
        raise ConfigError("model.checkpoint", f"{path} holds no checkpoint")
    try:
        return policy_from_state(state)
    except ValueError as exc:
        raise ConfigError("model.checkpoint", f"{path}: {exc}") from None
