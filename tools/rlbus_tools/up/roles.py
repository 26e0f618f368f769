"""The role processes of a local run: their command lines, environments and regions, in start order."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlbus.errors import ConfigError
from rlbus.launch.config import ENV_BLOB_FALLBACK_URL, ENV_BLOB_SECRET, ENV_BLOB_URL
from rlbus.launch.processes import rlbus_command, torchrun_command
from rlbus_tools.up.supervisor import Child

REGIONS = ("eu-west", "us-east", "ap-south", "sa-east")


def parse_regions(text: str) -> tuple[str, ...]:
    """``"eu-west,us-east"`` → the regions, checked: names as Kafka racks and Redis keys take them, no repeats."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise ConfigError("regions", "give at least one region, e.g. --regions eu-west,us-east")
    for name in names:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", name):
            raise ConfigError("regions", f"{name!r} is not a region name (lower-case letters, digits and '-')")
    if len(set(names)) != len(names):
        raise ConfigError("regions", f"{text!r} names a region twice")
    return names


def relay_child(region: str, origin: str, secret: str, root: Path, port: int) -> Child:
    """``rlbus blobs serve --upstream`` for ``region``: a pull-through cache of the origin in ``root``. It verifies
    the region's workers with the run's master secret and reads the origin with a read-only relay key."""
    from rlbus.blobs.keys import mint_for_role

    return Child(
        f"relay-{region}",
        [*rlbus_command(), "blobs", "serve", "--root", str(root), "--port", str(port), "--upstream", origin],
        {ENV_BLOB_SECRET: secret,
         "RLBUS_UPSTREAM_BLOB_SECRET": mint_for_role(secret, "relay", key_id=f"relay-{region}")},
    )


def worker_children(
    config_path: Path | None, rollout_workers: int, env: Mapping[str, str], regions: Sequence[str] = REGIONS,
    rollout_command: Sequence[str] | None = None, *, serve: bool = False, trainer_ranks: int = 1,
    relays: Mapping[str, str] | None = None,
) -> list[Child]:
    """The role processes of a run, in start order: trainer, reward, rollout workers, [the gateway,] prompts.
    ``rollout_command`` runs ``rlbus`` for the rollout workers (the vLLM environment's); default the same.
    The gateway (``serve``) runs the torch engine, in this environment. ``trainer_ranks`` > 1 (``[trainer]
    world_size``) starts the trainer under ``torch.distributed.run``, one process per rank. ``relays`` (region →
    relay URL): a region's rollout workers and gateway read blobs through its relay, the origin as fallback."""

    def regional(region: str) -> dict[str, str]:
        if relays is None or region not in relays:
            return dict(env)
        return {**env, ENV_BLOB_URL: relays[region], ENV_BLOB_FALLBACK_URL: env.get(ENV_BLOB_URL, "")}

    base = [*rlbus_command(), "worker"]
    rollout_base = [*rollout_command, "worker"] if rollout_command is not None else base
    tail = ["--config", str(config_path)] if config_path is not None else []
    trainer = [*(base if trainer_ranks == 1 else torchrun_command(trainer_ranks)), "trainer"]
    children = [Child("trainer", [*trainer, *tail, "--worker-id", "trainer"], dict(env)),
                Child("reward", [*base, "reward", *tail, "--worker-id", "reward-0"], dict(env))]
    for i in range(rollout_workers):
        region = regions[i % len(regions)]
        name = f"rollout-{i}"
        children.append(Child(name, [*rollout_base, "rollout", *tail, "--region", region, "--worker-id",
                                     f"{name}-{region}"], regional(region)))
    if serve:
        children.append(Child("serve", [*base, "serve", *tail, "--region", regions[0], "--worker-id", "serve"],
                              regional(regions[0])))
    children.append(Child("prompts", [*base, "prompts", *tail, "--worker-id", "prompts"], dict(env)))
    return children
