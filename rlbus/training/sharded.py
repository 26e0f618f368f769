"""Checkpoints of a trainer on N ranks: model and optimizer as torch.distributed.checkpoint (DCP) shards.

A trainer on several ranks (`rlbus.training.ranks`) checkpoints in two parts, both beside each other in
its checkpoint directory (`rlbus.training.checkpoint`)::

    <dir>/step-000000042.dcp/   DCP: every rank writes its shards of the weights and the Adam moments
    <dir>/step-000000042.pt     rank 0: the *full* weights (gathered) and the trainer's state, naming the
                                .dcp directory in ``sharded``; no optimizer
    <dir>/latest                names the .pt file, written last

The .pt file is a complete weights checkpoint, so ``[model] checkpoint``, ``rlbus generate`` and
`model_from_state` read it as they read a one-process checkpoint. DCP stores each tensor with its global
shape and reshards on load, so a run resumes on another number of ranks: `load_sharded` reads the
directory into a model sharded any way (or not sharded at all: a one-process trainer continues an N-rank
run), and `load_full` reads a one-process checkpoint (full weights, the optimizer keyed by position)
into a sharded model. A Hugging Face model's tensors are named by its inner HF module in both parts
(`rlbus.training.ranks.state_module`), exactly as in its one-process checkpoints.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import torch

from rlbus.models.base import TrainableLM
from rlbus.training.ranks import state_module

SUFFIX = ".dcp"


def sharded_name(step: int) -> str:
    """The DCP directory of the checkpoint at ``step`` (beside its ``step-….pt``)."""
    return f"step-{step:09d}{SUFFIX}"


def save_sharded(path: Path, model: TrainableLM, optimizer: torch.optim.Optimizer) -> None:
    """Write this rank's shards of the model and optimizer to the DCP directory ``path``. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = state_module(model)  # a Hugging Face wrapper's inner model: the names DCP maps
    path.mkdir(parents=True, exist_ok=True)
    state = {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, optimizer)}
    dcp.save(state, checkpoint_id=path)


def load_sharded(path: Path, model: TrainableLM, optimizer: torch.optim.Optimizer) -> None:
    """Load the DCP directory ``path`` into ``model`` and ``optimizer``, however they are sharded now
    (collective on N ranks; a plain read in one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module = state_module(model)  # a Hugging Face wrapper's inner model: the names DCP maps
    state: dict[str, Any] = {"model": get_model_state_dict(module),
                             "optim": get_optimizer_state_dict(module, optimizer)}
    with warnings.catch_warnings():  # one process reading an N-rank checkpoint is what we mean
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, optimizer, state["optim"])


def load_full(
    model: TrainableLM, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
) -> None:
    """Load a one-process checkpoint's full ``weights`` and ``optimizer_state`` (``optimizer.state_dict()``,
    keyed by position) into a sharded ``model`` and its optimizer; every rank passes the same and keeps
    its own shard of each tensor (no communication). ``optimizer`` must order its parameters as the one
    that wrote the state did, which `rlbus.training.step.build_optimizer` does for any sharding. Each
    Adam moment is made like the optimizer makes its own (``zeros_like`` the parameter: its DTensor spec)
    and filled with this rank's slice."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            _shard_like(weights[name], param, into=True)
        for name, buffer in state_module(model).named_buffers():  # named as ``weights`` are
            if name in weights:
                buffer.copy_(weights[name])
    if optimizer_state is None:
        return
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in optimizer_state["state"].items():
        param = ordered[int(index)]
        optimizer.state[param] = {k: _shard_like(v, param) for k, v in entries.items()}
    for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _shard_like(full: Any, like: torch.Tensor, *, into: bool = False) -> Any:
    """``full`` cut to this rank's shard of ``like`` (a DTensor parameter): copied into it with ``into``,
    else returned as a DTensor sharded like it. Anything else (Adam's step count) is returned as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(like.shape):
        return full
    if not isinstance(like, DTensor):
        return like.copy_(full) if into else full
    local = distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()
    if into:
        like.to_local().copy_(local)
        return like
    out = cast(DTensor, torch.zeros_like(like, memory_format=torch.preserve_format))  # the parameter's own spec
    out.to_local().copy_(local)
    return out
