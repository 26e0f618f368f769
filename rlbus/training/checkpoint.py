"""Trainer checkpoints: everything a restart needs to continue exactly where it stopped.

A checkpoint holds the fp32 master weights, the optimizer state (Adam moments and step counts), the
trainer step and the last published policy version, the RNG states (torch CPU and CUDA, Python's
`random`), the bus offsets the caller has consumed (so a restarted trainer reads exactly the records after
them) and the model's description (`TrainableLM.describe`: an in-repo policy's shape, or a Hugging Face
model's config or source), so a checkpoint rebuilds its own model (`model_from_state`). Restoring all of
it and feeding the same data makes the next step bit-identical to an uninterrupted run.

Layout and atomicity::

    <dir>/step-000000042.pt   one file per checkpoint (torch.save; read back with weights_only=True)
    <dir>/latest              the file name of the newest complete checkpoint
    <dir>/step-000000042.dcp/ a trainer on N ranks only: model and optimizer shards (`rlbus.training.sharded`)

A checkpoint file is written under a temporary name, fsynced and renamed into place (``os.replace`` is
atomic on POSIX); only then is ``latest`` replaced the same way and the directory fsynced. A crash at any
point leaves ``latest`` naming a complete file, the previous checkpoint or the new one. Files older than
the newest ``keep`` are deleted after ``latest`` has moved on.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rlbus.models.base import TrainableLM
from rlbus.models.policy import Policy

LATEST = "latest"
_NAME = re.compile(r"step-(\d{9})\.pt")
_SHARDED = re.compile(r"step-(\d{9})\.dcp")


@dataclass
class TrainerState:
    """The contents of one checkpoint."""

    step: int
    """Optimizer updates done so far (trainer steps, not minibatches)."""
    version: int
    """Last policy version published (0 before the first)."""
    model: dict[str, torch.Tensor]
    """fp32 master weights (``model.state_dict()``, a tied tensor under each of its names), on CPU."""
    optimizer: dict[str, Any] | None = None
    """``optimizer.state_dict()``; None for a weights-only checkpoint (e.g. after the supervised warm start)."""
    rng: dict[str, Any] = field(default_factory=dict)
    """`capture_rng()` at save time."""
    offsets: dict[str, int] = field(default_factory=dict)
    """Consumed bus offsets as the caller names them (e.g. ``"rl.rollouts.v1:3" → 1042``)."""
    model_description: dict[str, Any] | None = None
    """``model.describe()``, so the model can be rebuilt from the checkpoint alone (`model_from_state`).
    Read from a checkpoint that predates it as ``{"kind": "policy", "shape": <its policy_config>}``."""
    rollouts_trained: int = 0
    """Rollouts in the updates this model holds (cumulative): equal to the ledger's "trained" count
    when the trainer settles outcomes with its checkpoints (what the chaos suite checks)."""
    sharded: str | None = None
    """A trainer on N ranks: the DCP directory beside this file holding the model and optimizer shards
    (`rlbus.training.sharded`); ``model`` is then the same weights gathered and ``optimizer`` None."""


def capture_rng() -> dict[str, Any]:
    """Every RNG stream the trainer may draw from."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng` (streams missing from ``state`` are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, state: TrainerState, *, keep: int = 2) -> Path:
    """Write ``state`` atomically as the newest checkpoint of ``directory``; returns its path."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    directory.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:09d}.pt"
    payload = {
        "step": state.step,
        "version": state.version,
        "model": {k: v.detach().to("cpu") for k, v in state.model.items()},
        "optimizer": state.optimizer,
        "rng": state.rng,
        "offsets": dict(state.offsets),
        "model_description": state.model_description,
        "rollouts_trained": state.rollouts_trained,
        "sharded": state.sharded,
    }
    _atomic_write(directory / name, lambda f: torch.save(payload, f))
    _atomic_write(directory / LATEST, lambda f: f.write(name.encode()))
    _fsync_dir(directory)
    for old in sorted(p for p in directory.iterdir() if _NAME.fullmatch(p.name))[:-keep]:
        if old.name != name:
            old.unlink(missing_ok=True)
    kept = {p.name.removesuffix(".pt") for p in directory.iterdir() if _NAME.fullmatch(p.name)}
    for shards in directory.iterdir():  # DCP directories of the checkpoints just deleted
        if _SHARDED.fullmatch(shards.name) and shards.name.removesuffix(".dcp") not in kept:
            shutil.rmtree(shards, ignore_errors=True)
    return directory / name


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint file of ``directory``, or None if there is none."""
    try:
        name = (directory / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    if not _NAME.fullmatch(name):
        raise ValueError(f"{directory / LATEST} names {name!r}, not a checkpoint file")
    return directory / name


def load_checkpoint(path: Path) -> TrainerState | None:
    """Read a checkpoint file, or the newest one of a directory (None when the directory has none)."""
    file = latest_checkpoint(path) if path.is_dir() else path
    if file is None:
        return None
    data = torch.load(file, map_location="cpu", weights_only=True)
    return TrainerState(
        step=int(data["step"]),
        version=int(data["version"]),
        model=data["model"],
        optimizer=data["optimizer"],
        rng=data["rng"],
        offsets={str(k): int(v) for k, v in data["offsets"].items()},
        model_description=_description(data),
        rollouts_trained=int(data.get("rollouts_trained", 0)),  # absent in checkpoints before it existed
        sharded=data.get("sharded"),
    )


def model_from_state(state: TrainerState) -> TrainableLM:
    """Rebuild the model a checkpoint was taken from (fp32, on CPU), with its weights."""
    description = state.model_description
    if description is None:
        raise ValueError("this checkpoint does not describe its model")
    from rlbus.models.sources import model_from_description

    model = model_from_description(description, dtype=torch.float32)
    model.load_state_dict(state.model)
    return model


def policy_from_state(state: TrainerState) -> Policy:
    """`model_from_state` for callers that need the in-repo `Policy` (its config); ValueError for another kind."""
    model = model_from_state(state)
    if not isinstance(model, Policy):
        raise ValueError(f"this checkpoint holds a {type(model).__name__}, not an in-repo policy")
    return model


def _description(data: dict[str, Any]) -> dict[str, Any] | None:
    if data.get("model_description") is not None:
        return dict(data["model_description"])
    if data.get("policy_config") is not None:  # written before checkpoints described any model kind
        return {"kind": "policy", "shape": dict(data["policy_config"])}
    return None


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
