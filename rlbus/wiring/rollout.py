"""The rollout stack: model → engine → weight sync → rollout worker.

Every rollout worker of every entry point is built here: the engine kind ``engine`` names
(`rlbus.engines.kinds`: ``torch``, ``vllm``, or a user's) serves a bf16 copy of the run's model
(`rlbus.models.kinds.ModelSource`) behind the batching engine that merges the episodes' decode calls, the
kind's `WeightSync` follows the trainer's versions and swaps them in between decode steps, and the
`RolloutWorker` plays prompts on the bus. The stack's one notion of "the version this engine serves" is set
inside the swap, so the engine stamps tokens with the version they were sampled from. An engine that runs in
another Python environment (vLLM) needs the process to run there (`EngineKind.python`; ``rlbus up`` starts it
so).
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
    from rlbus.envs.chat import ChatFormat
    from rlbus.models.sources import Model, ModelSource
    from rlbus.schemas import Rollout
    from rlbus.weights.sync import WeightSync


@dataclass
class RolloutStack:
    """One rollout worker's parts; ``sync`` is None when the worker serves fixed weights. ``engine`` is the
    engine kind's engine (`rlbus.engines.kinds.Served`)."""

    weights: Model
    engine: Any
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
    engine_options: Mapping[str, Any] | None = None,
    prefix_cache_tokens: int = 0,
) -> RolloutStack:
    """A rollout worker over a bf16 copy of ``model`` served by the engine kind ``engine``, sampling with
    ``seed``.

    With a ``store`` the worker follows the trainer's versions through the kind's `WeightSync`; without one it
    serves ``initial`` (fp32 or bf16 weights, cast) as version 0. ``on_swap(version, weights)`` runs inside
    each swap, after the engine's version is set. ``engine_options`` go to the kind (vLLM's `VLLMEngine`
    keywords); ``prefix_cache_tokens`` is the torch engine's prefix cache (vLLM keeps its own).
    """
    from rlbus.consumers.rollout import RolloutWorker
    from rlbus.engines.kinds import engine_kind
    from rlbus.schemas import SamplingInfo

    served = engine_kind(engine).serve(model, initial=initial, seed=seed, max_batch=max_batch,
                                       batch_window_s=batch_window_s, prefix_cache_tokens=prefix_cache_tokens,
                                       options=engine_options)
    sync = None
    if store is not None:
        sync = served.follow(bus=bus, store=store, model_id=model_id, worker_id=worker_id, on_swap=on_swap)
    chat = model.chat
    worker = RolloutWorker(
        bus=bus, engine=served.batching, chat=chat, worker_id=worker_id, region=region, model_id=model_id,
        sampling=SamplingInfo(temperature=temperature), prompts_in_flight=prompts_in_flight, on_policy=on_policy,
        on_rollout=on_rollout,
    )
    return RolloutStack(weights=served.weights, engine=served.engine, batching=served.batching, sync=sync,
                        worker=worker, chat=chat)
