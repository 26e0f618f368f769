"""Where a role's models run: ``--device`` / ``[model] device`` resolved once, announced, and a shared GPU split.

``auto`` (every command's default and ``[model] device``'s) is the current CUDA device when PyTorch sees one,
else the CPU; ``cuda`` without a GPU is a ConfigError naming what torch sees, not a crash deep in a load. A
role resolves its device once (`rlbus.launch.arguments.model_source`, `rlbus.models.sources.parse_model`), so
every model it builds — trainer master, rollout copies, judge, evaluation — lands on the same one, and logs it
at start (`announce`): the device, the GPU's name and its memory, total and free.

Sharing one GPU. Roles in one process (``rlbus demo``: trainer, rollout workers, judge) share its CUDA
context and allocator; each holds its own copy of the weights (the trainer's fp32 master and optimizer, a
bf16 copy per rollout engine, whose KV arena is bounded by ``max_batch`` × context). Roles in separate
processes on one GPU (``rlbus up``, or roles started by hand on a one-GPU node) each cap their allocator
at ``RLBUS_GPU_MEMORY_FRACTION`` of the card when it is set (`torch.cuda.set_per_process_memory_fraction`):
give the trainer the larger share (it needs about 16 bytes per parameter plus activations, a rollout
engine about 2 plus its KV arena). Which GPU a process uses is ``CUDA_VISIBLE_DEVICES``' business (the
trainer's ranks take ``LOCAL_RANK``'s, `rlbus.training.ranks`); one rollout engine per GPU is the layout
that scales.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlbus.errors import ConfigError

log = logging.getLogger(__name__)
ENV_FRACTION = "RLBUS_GPU_MEMORY_FRACTION"
_announced: set[str] = set()


def resolve_device(spec: str | torch.device) -> torch.device:
    """``auto`` → the current CUDA device when there is one, else the CPU; ``cuda``/``cuda:N`` checked
    against what torch sees (ConfigError otherwise); anything else as torch spells it."""
    text = str(spec)
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise ConfigError("model.device", f"{text!r} is not a device: {exc}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError("model.device", f"{text!r} asked for, but torch sees no CUDA device "
                              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu or auto")
        if device.index is not None and device.index >= count:
            raise ConfigError("model.device", f"{text!r} asked for, but torch sees {count} CUDA device(s)")
    return device


@dataclass(frozen=True)
class DeviceInfo:
    """What a role logs about its device."""

    device: str
    name: str
    memory_gib: float
    free_gib: float | None = None
    capability: str | None = None
    memory_fraction: float | None = None

    def line(self) -> str:
        free = "" if self.free_gib is None else f", {self.free_gib:.1f} GiB free"
        cap = "" if self.memory_fraction is None else f", capped at {self.memory_fraction:.0%} ({ENV_FRACTION})"
        return f"{self.device} ({self.name}, {self.memory_gib:.1f} GiB{free}{cap})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(device: torch.device) -> DeviceInfo:
    """The device's name and memory (the GPU's; the machine's RAM for the CPU)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        return DeviceInfo(device=f"cuda:{index}", name=props.name, memory_gib=total / 2**30, free_gib=free / 2**30,
                          capability=f"{props.major}.{props.minor}")
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return DeviceInfo(device=str(device), name=f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
                      memory_gib=pages * size / 2**30)


def share(device: torch.device) -> float | None:
    """Cap this process's share of a CUDA device at ``RLBUS_GPU_MEMORY_FRACTION`` when set (the sharing
    policy in the module docstring); returns the fraction applied."""
    text = os.environ.get(ENV_FRACTION)
    if not text:
        return None
    try:
        fraction = float(text)
    except ValueError:
        raise ConfigError(ENV_FRACTION, f"{text!r} is not a number in (0, 1]") from None
    if not 0 < fraction <= 1:
        raise ConfigError(ENV_FRACTION, f"{fraction} is not in (0, 1]")
    if device.type != "cuda":
        return None
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def announce(device: str | torch.device, *, say: Callable[[str], None] | None = None) -> DeviceInfo:
    """Resolve ``device``, apply the sharing policy and log where the role's models run (once per process and
    device, however many models a process builds there)."""
    resolved = resolve_device(device)
    info = describe(resolved)
    if info.device not in _announced:
        _announced.add(info.device)
        fraction = share(resolved)
        if fraction is not None:
            info = DeviceInfo(**{**info.as_dict(), "memory_fraction": fraction})
        (say or log.info)(f"models on {info.line()}")
    return info
