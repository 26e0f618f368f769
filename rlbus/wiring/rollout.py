"""The rollout stack: model → engine → weight sync → rollout worker.

Every rollout worker of every entry point is built here: a bf16 copy of the run's model (the in-house
policy or an HF model, `rlbus.models.sources.ModelSource`), the torch engine over
it (behind the batching engine that merges the episodes' decode calls; the chain is
`rlbus.engines.torch_stack`'s, which the judge and the evaluation share), the `WeightSync` that follows
the trainer's versions and swaps them in between decode steps, and the `RolloutWorker` on the bus. The
stack's one notion of "the version this engine serves" is set inside the swap, so the engine stamps
tokens with the version they were sampled from.

With ``engine="vllm"`` the engine is vLLM (`rlbus.engines.vllm_engine`; the process must run in the vLLM
environment, ``make vllm-env``): the bf16 copy stays as the worker's mirror in trainer names, which weight sync
stages against, and each swap hands vLLM the tensors that changed (`rlbus.engines.vllm_sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlbus.blobs.base import BlobStore
from rlbus.bus.base import Bus

if TYPE_CHECKING:
    import torch

    from rlbus.consumers.rollout import RolloutWorker
    from rlbus.engines.batching import BatchingEngine
    from rlbus.engines.torch_engine import TorchEngine
    from rlbus.engines.vllm_engine import VLLMEngine
    from rlbus.envs.chat import ChatFormat
    from rlbus.models.sources import Model, ModelSource
    from rlbus.schemas import Rollout
    from rlbus.weights.sync import WeightSync


@dataclass
class RolloutStack:
    """One rollout worker's parts; ``sync`` is None when the worker serves fixed weights."""

    weights: Model
    engine: TorchEngine | VLLMEngine
    batching: BatchingEngine
    sync: WeightSync | None
    worker: RolloutWorker
    chat: ChatFormat


def rollout_stack(
    *,
    bus: Bus,
    store: BlobStore | None,
    model: ModelSource,
    worker_id: str,
    seed: int,
    region: str = "",
    model_id: str = "policy",
    initial: Mapping[str, torch.Tensor] | None = None,
    temperature: float = 1.0,
    prompts_in_flight: int = 2,
    max_batch: int = 64,
    batch_window_s: float = 0.003,
    on_policy: bool = False,
    on_swap: Callable[[int, Model], None] | None = None,
    on_rollout: Callable[[Rollout], None] | None = None,
    engine: str = "torch",
    vllm_kwargs: Mapping[str, Any] | None = None,
    prefix_cache_tokens: int = 0,
) -> RolloutStack:
    """A rollout worker over a bf16 copy of ``model``, sampling with ``seed``.

    With a ``store`` the worker follows the trainer's versions through a `WeightSync` (double-buffered:
    the swap re-points parameters); without one it serves ``initial`` (fp32 or bf16 weights, cast) as
    version 0. ``on_swap(version, weights)`` runs inside each swap, after the engine's version is set.
    ``engine`` is ``torch`` or ``vllm`` (``vllm_kwargs`` go to `VLLMEngine`); ``prefix_cache_tokens`` is
    the torch engine's prefix cache (vLLM keeps its own).
    """
    if engine == "vllm":
        return _vllm_stack(
            bus=bus, store=store, model=model, worker_id=worker_id, seed=seed, region=region, model_id=model_id,
            initial=initial, temperature=temperature, prompts_in_flight=prompts_in_flight, max_batch=max_batch,
            batch_window_s=batch_window_s, on_policy=on_policy, on_swap=on_swap, on_rollout=on_rollout,
            vllm_kwargs=vllm_kwargs,
        )
    if engine != "torch":
        from rlbus.errors import ConfigError

        raise ConfigError("rollout.engine", f"{engine!r} is neither torch nor vllm")
    from rlbus.consumers.rollout import RolloutWorker
    from rlbus.engines.torch_stack import torch_stack
    from rlbus.schemas import SamplingInfo
    from rlbus.weights.sync import WeightSync, bind_module, live_state

    served = torch_stack(model, initial=initial, seed=seed, max_batch=max_batch,
                         prefix_cache_tokens=prefix_cache_tokens, batch_window_s=batch_window_s)
    weights, torch_engine, batching, chat = served.weights, served.engine, served.batching, model.chat

    def swapped(version: int) -> None:  # inside the swap: the engine now serves ``version``
        torch_engine.policy_version = version
        if on_swap is not None:
            on_swap(version, weights)

    sync = None
    if store is not None:
        sync = WeightSync(bus=bus, store=store, state=live_state(weights), bind=bind_module(weights),
                          swap=torch_engine.swap_point.apply, on_swap=swapped, model_id=model_id, worker_id=worker_id)
    worker = RolloutWorker(
        bus=bus, engine=batching, chat=chat, worker_id=worker_id, region=region, model_id=model_id,
        sampling=SamplingInfo(temperature=temperature), prompts_in_flight=prompts_in_flight, on_policy=on_policy,
        on_rollout=on_rollout,
    )
    return RolloutStack(weights=weights, engine=torch_engine, batching=batching, sync=sync, worker=worker, chat=chat)


def _vllm_stack(
    *, bus: Bus, store: BlobStore | None, model: ModelSource, worker_id: str, seed: int, region: str, model_id: str,
    initial: Mapping[str, torch.Tensor] | None, temperature: float, prompts_in_flight: int, max_batch: int,
    batch_window_s: float, on_policy: bool, on_swap: Callable[[int, Model], None] | None,
    on_rollout: Callable[[Rollout], None] | None, vllm_kwargs: Mapping[str, Any] | None,
) -> RolloutStack:
    """`rollout_stack` on vLLM: the bf16 mirror in trainer names, vLLM over the model's directory, and the
    `VLLMWeightSync` that stages against the mirror and pushes each version's changes into vLLM."""
    from rlbus.consumers.rollout import RolloutWorker
    from rlbus.engines.batching import BatchingEngine
    from rlbus.engines.torch_stack import inference_copy
    from rlbus.engines.vllm_engine import VLLMEngine
    from rlbus.engines.vllm_sync import VLLMWeightSync, push_staged
    from rlbus.errors import ConfigError
    from rlbus.schemas import SamplingInfo
    from rlbus.weights.sync import bind_module, live_state

    if model.directory is None:
        raise ConfigError("rollout.engine", "engine = \"vllm\" needs a Hugging Face model ([model] name, path or gguf)")
    weights = inference_copy(model, initial=initial)
    chat = model.chat
    engine = VLLMEngine(model.directory, seed=seed, max_batch=max_batch, **dict(vllm_kwargs or {}))
    # vLLM loaded the directory itself; hand it the mirror once, so both hold the same bits from the start
    # and the extension holds what it was given (its digest).
    engine.push(live_state(weights), version=0)

    sync: VLLMWeightSync | None = None

    def swapped(version: int) -> None:  # inside the swap: the mirror holds ``version``; now vLLM
        assert sync is not None
        push_staged(engine, live_state(weights), sync.staged, version)
        if on_swap is not None:
            on_swap(version, weights)

    if store is not None:
        sync = VLLMWeightSync(engine=engine, bus=bus, store=store, state=live_state(weights),
                              bind=bind_module(weights), swap=engine.swap_point.apply, on_swap=swapped,
                              model_id=model_id, worker_id=worker_id)
    batching = BatchingEngine(engine, max_batch=max_batch, window_s=batch_window_s)
    worker = RolloutWorker(
        bus=bus, engine=batching, chat=chat, worker_id=worker_id, region=region, model_id=model_id,
        sampling=SamplingInfo(temperature=temperature), prompts_in_flight=prompts_in_flight, on_policy=on_policy,
        on_rollout=on_rollout,
    )
    return RolloutStack(weights=weights, engine=engine, batching=batching, sync=sync, worker=worker, chat=chat)
