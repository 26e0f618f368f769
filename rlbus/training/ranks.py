"""The trainer on N ranks: its process group, FSDP2 sharding, and the full weights gathered on rank 0.

One trainer, several processes (``torchrun --nproc-per-node N -m rlbus worker trainer``, or ``[trainer]
world_size = N`` under ``rlbus up``). Rank 0, the *leader*, is the only one on the bus: it consumes and
joins, keeps the ledger, publishes and names checkpoints; every step it broadcasts the command and its
batch (`Ranks.broadcast`) and the other ranks, the *followers*, run the same command
(`rlbus.training.trainer.Trainer.follow`). Nothing but rank 0 opens a consumer (docs/architecture.md §9.6).

Sharding is PyTorch's own FSDP2: ``fully_shard`` on each transformer block, then on the root (embedding,
final norm, LM head), with a `MixedPrecisionPolicy` from `FSDPConfig`. Gradients are *summed* across ranks
(FSDP's divide factor set to 1), because each rank's loss is already divided by the step's global token
count (`rlbus.training.step`), so the sum is the one-process gradient. The transport is gloo on CPU and
NCCL on GPU (objects always travel over gloo).

A Hugging Face model (`rlbus.models.hf.HFCausalLM`) is sharded the same way — each decoder layer, then the
wrapper as the root (it owns the HF embedding, final norm and LM head, so ``features``, which calls the HF
decoder directly, runs the root's FSDP hooks) — but its state is *named* by the inner HF module: the
wrapper's ``state_dict`` / ``named_parameters`` drop its ``hf.`` prefix, which DCP's FQN mapping cannot
follow, so `state_module` (``model.hf``) is what `full_state`, `rlbus.training.sharded` and
``get_optimizer_state_dict`` see. Its names are the HF ones (``model.layers.0.…``, ``lm_head.weight``):
the same as the one-process trainer's checkpoints and published weights. A tied embedding / LM head is
one parameter, in the root's group, published once under ``model.embed_tokens.weight``.

A MoE expert that a rank routed no token to still joins the reduction with a zero gradient (the ranks'
reductions must match); one no rank routed to is then decayed and stepped by AdamW with a zero gradient,
where a one-process trainer leaves a parameter without gradient untouched: dense models match exactly.
(An HF MoE whose experts are fused into one [E, …] tensor per layer, as transformers 5's Qwen3-MoE,
always gives that tensor a gradient, zero rows for experts nobody routed to, on one rank as on N.)

Published weights are encoded per rank (`rlbus.training.shard_publish`): each rank owns a run of whole
tensors, gets them cast to the inference dtype from every rank's shard, delta-encodes and uploads them; rank
0 writes the one manifest. `full_weights` (the full tensors gathered on rank 0 with
``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) remains for checkpoints and for a
publisher that takes whole weights.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rlbus.models.base import TrainableLM
from rlbus.training.config import FSDPConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: How long a collective may wait. The followers wait in a broadcast for as long as rank 0 waits for data
#: (a run with no rollouts for an hour is not broken), so it is long; a rank that dies is noticed at once
#: anyway, by its closed connections, and torchrun then stops the others.
COLLECTIVE_TIMEOUT = timedelta(days=7)


class Ranks:
    """This process's place among the trainer's ranks, and the few collectives the trainer needs."""

    def __init__(self, *, rank: int, world: int, device: torch.device | None = None) -> None:
        """``device`` is where tensor collectives run (the model's device)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.rank = rank
        self.world = world
        self.device = device or torch.device("cpu")

    @property
    def leader(self) -> bool:
        """Rank 0: the one process on the bus."""
        return self.rank == 0

    def rows(self, start: int, stop: int, rank: int | None = None) -> tuple[int, int]:
        """``rank``'s (default: this rank's) contiguous slice of rows [start, stop): ⌈n/world⌉ rows each,
        the last ranks possibly fewer or none."""
        r = self.rank if rank is None else rank
        per = -(-(stop - start) // self.world)
        return min(start + r * per, stop), min(start + (r + 1) * per, stop)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; the other ranks' ``obj`` is ignored)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``tensor`` over ranks, in place (on every rank)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def collect(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0 only (None on the others): what only the leader
        needs, such as the chunks a rank could not upload, does not travel to every rank."""
        out: list[Any] | None = [None] * self.world if self.leader else None
        dist.gather_object(obj, out, dst=0)
        return out


def world_size_for(configured: int) -> int:
    """``[trainer] world_size`` as a rank count: 0 means one rank per CUDA device here (1 without one)."""
    if configured > 0:
        return configured
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def join_ranks(world_size: int) -> Ranks | None:
    """Join the trainer's process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR …);
    None, and no process group, for a one-process trainer. ValueError when the launch and ``world_size``
    disagree."""
    world_size = world_size_for(world_size)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world_size:
        raise ValueError(f"trainer.world_size = {world_size} but this trainer was launched on {launched} rank(s): "
                         "start it with `torchrun --nproc-per-node <world_size> -m rlbus worker trainer`")
    if world_size == 1:
        return None
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                timeout=COLLECTIVE_TIMEOUT)
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def leave_ranks(ranks: Ranks | None) -> None:
    """Leave the process group `join_ranks` joined."""
    if ranks is not None and dist.is_initialized():
        dist.destroy_process_group()


def transformer_blocks(model: TrainableLM) -> Sequence[nn.Module]:
    """The repeated blocks FSDP wraps one by one: the in-repo policy's ``blocks``, a Hugging Face decoder's
    ``layers``."""
    blocks = getattr(model, "blocks", None)
    if blocks is None and hasattr(model, "hf"):
        blocks = getattr(model.hf.get_decoder(), "layers", None)
    if blocks is None:
        raise ValueError(f"cannot find the transformer blocks of a {type(model).__name__} to shard")
    return list(blocks)


def share_weights(model: nn.Module, ranks: Ranks) -> None:
    """Give every rank rank 0's weights (parameters and buffers) before sharding, so a model built on
    each rank from the same description starts from the leader's exact tensors."""
    with torch.no_grad():
        for tensor in model.state_dict().values():  # a tied tensor twice, harmlessly
            dist.broadcast(tensor, src=0)


def shard_model(model: TrainableLM, ranks: Ranks, config: FSDPConfig) -> TrainableLM:
    """``fully_shard`` each block, then the root, in place; the model's parameters become DTensor shards.
    Build the optimizer after this. ``features`` runs the FSDP hooks like ``forward`` does. The root is
    ``model`` itself, a Hugging Face wrapper included (its ``features`` is what the trainer calls); only
    its state goes through `state_module`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[config.param_dtype], reduce_dtype=DTYPES[config.reduce_dtype])
    module: Any = model
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(module, "features")
    for part in module.modules():  # each rank's loss is divided by the global token count: sum, do not average
        if hasattr(part, "set_gradient_divide_factor"):  # (a plain SUM: gloo has no pre-multiplied sum)
            part.set_gradient_divide_factor(1.0)
            part.set_force_sum_reduction_for_comms(True)
            part.set_reduce_scatter_unused_params(True, recurse=False)  # experts one rank routed nothing to
    return model


def full_weights(model: TrainableLM) -> dict[str, torch.Tensor]:
    """The model's full parameters on CPU, on rank 0 (an empty dict on the others): the weights the
    publisher encodes, named and deduplicated like `rlbus.models.base.weight_tensors`. Collective."""
    full = full_state(model)
    if not full:
        return {}
    return {name: full[name] for name, _ in model.named_parameters()}


def full_state(model: TrainableLM) -> dict[str, torch.Tensor]:
    """The model's full state dict (parameters and buffers) on CPU, on rank 0 ({} elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(state_module(model), options=options))


def state_module(model: TrainableLM) -> nn.Module:
    """The module whose names a checkpoint uses, as DCP (``get_model_state_dict``, ``get_optimizer_state_dict``,
    ``dcp.save``/``load``) must see it: the model itself, or the inner ``model.hf`` of a Hugging Face
    wrapper, whose ``state_dict`` and ``named_parameters`` are the HF model's (no ``hf.`` prefix) while its
    module tree has one. Holds every parameter the optimizer steps."""
    inner = getattr(model, "hf", None)
    return inner if isinstance(inner, nn.Module) else cast(nn.Module, model)
