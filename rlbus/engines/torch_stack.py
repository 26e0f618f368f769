"""The torch inference chain: a copy of the weights in the inference dtype → the torch engine → the batching
engine.

Every model that rlbus serves with the torch engine is built here: the rollout workers
(`rlbus.wiring.rollout`), the local LM judge (`rlbus.rewards.judge.engine_judge`), the held-out evaluation
(`rlbus.envs.evaluate`), ``rlbus generate`` and the benchmarks. The copy is made from a `ModelSource`
(built in ``dtype`` on the source's device, in eval mode) or from a model in memory (a deep copy, cast to
``dtype``, in eval mode); the model given is never changed. The batching engine merges the decode calls of
concurrent episodes (`rlbus.engines.batching`); a caller that makes one call at a time uses the torch
engine directly.

The vLLM rollout stack keeps a copy too (the mirror its weight sync stages against): `inference_copy` is
that copy, shared with the chain. A `TorchStack` is the torch engine kind's `rlbus.engines.kinds.Served`
(`rlbus.engines.torch_kind`): `TorchStack.follow` is the weight sync that swaps versions into its copy.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, overload

import torch

from rlbus.engines.base import TokenDecoder
from rlbus.engines.batching import BatchingEngine
from rlbus.engines.constraints import grammars_for
from rlbus.engines.kinds import OnSwap, Served
from rlbus.engines.torch_engine import TorchEngine

if TYPE_CHECKING:
    from rlbus.blobs.base import BlobStore
    from rlbus.bus.base import Bus
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.policy import Policy
    from rlbus.models.sources import Model, ModelSource
    from rlbus.weights.sync import WeightSync

#: A model in memory: its copy is of its own class.
M = TypeVar("M", bound="Policy | HFCausalLM")


@dataclass
class TorchStack(Served):
    """A served copy and its engines; ``batching`` wraps ``engine``."""

    weights: Model
    engine: TorchEngine
    batching: BatchingEngine

    def follow(
        self, *, bus: Bus, store: BlobStore, model_id: str, worker_id: str, on_swap: OnSwap | None = None
    ) -> WeightSync:
        """The `WeightSync` of the copy (double-buffered: the swap re-points its parameters, at the engine's
        swap point); inside each swap the engine's version is set, then ``on_swap`` runs."""
        from rlbus.weights.sync import WeightSync, bind_module, live_state

        weights, engine = self.weights, self.engine

        def swapped(version: int) -> None:  # inside the swap: the engine now serves ``version``
            engine.policy_version = version
            if on_swap is not None:
                on_swap(version, weights)

        return WeightSync(bus=bus, store=store, state=live_state(weights), bind=bind_module(weights),
                          swap=engine.swap_point.apply, on_swap=swapped, model_id=model_id, worker_id=worker_id)


@overload
def inference_copy(
    model: ModelSource, *, dtype: torch.dtype = ..., initial: Mapping[str, torch.Tensor] | None = ...
) -> Model: ...


@overload
def inference_copy(model: M, *, dtype: torch.dtype = ..., initial: Mapping[str, torch.Tensor] | None = ...) -> M: ...


def inference_copy(
    model: ModelSource | Model,
    *,
    dtype: torch.dtype = torch.bfloat16,
    initial: Mapping[str, torch.Tensor] | None = None,
) -> Model:
    """``model`` in ``dtype``, in eval mode: a source built afresh, a model in memory deep-copied and cast.
    ``initial`` (weights in any float dtype, cast) replaces the copy's weights."""
    from rlbus.models.sources import ModelSource

    if isinstance(model, ModelSource):
        weights = model.build(dtype).eval()
    else:
        weights = copy.deepcopy(model).to(dtype).eval()
    if initial is not None:
        weights.load_state_dict({name: t.to(dtype) for name, t in initial.items()})
    return weights


def torch_stack(
    model: ModelSource | Model,
    *,
    dtype: torch.dtype = torch.bfloat16,
    initial: Mapping[str, torch.Tensor] | None = None,
    tokenizer: TokenDecoder | None = None,
    pad_id: int | None = None,
    seed: int = 0,
    max_batch: int = 32,
    prefix_cache_tokens: int = 0,
    batch_window_s: float = 0.005,
    batch_calls: int | None = None,
) -> TorchStack:
    """The torch engine over `inference_copy` (``model``, ``dtype``, ``initial``), sampling with ``seed``,
    ``max_batch`` rows in flight and a prefix cache of ``prefix_cache_tokens`` (0: none), behind a batching
    engine that gathers calls for ``batch_window_s`` and hands at most ``batch_calls`` (default
    ``max_batch``) over at once. ``tokenizer`` and ``pad_id`` default to a source's chat format and pad id;
    a model in memory has no tokenizer unless given one, and pads with 0. A chat-format tokenizer also gives
    the engine its grammars (constrained decoding, `rlbus.engines.constraints`)."""
    from rlbus.models.sources import ModelSource

    weights = inference_copy(model, dtype=dtype, initial=initial)
    if isinstance(model, ModelSource):
        tokenizer = model.chat if tokenizer is None else tokenizer
        pad_id = model.pad_id if pad_id is None else pad_id
    engine = TorchEngine(weights, tokenizer=tokenizer, seed=seed, pad_id=0 if pad_id is None else pad_id,
                         max_batch=max_batch, prefix_cache_tokens=prefix_cache_tokens,
                         grammars=grammars_for(tokenizer))
    batching = BatchingEngine(engine, max_batch=max_batch if batch_calls is None else batch_calls,
                              window_s=batch_window_s)
    return TorchStack(weights=weights, engine=engine, batching=batching)
