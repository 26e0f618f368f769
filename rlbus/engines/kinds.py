"""Inference engine kinds: what ``[rollout] engine`` names, and what serving a model takes (docs/extending.md).

An engine kind (`EngineKind`) is one module that builds, from a run's model source, everything a rollout
worker (`rlbus.wiring.rollout`), the gateway (`rlbus.serve.stack`) or a local LM judge
(`rlbus.rewards.judge.engine_judge`) serves the model with — a `Served`:

* ``weights``: the copy of the model in the inference dtype, under the trainer's tensor names, which weight sync
  stages each version's delta against (the engine's own weights for torch; a mirror beside vLLM's);
* ``engine``: what generates (`rlbus.engines.base.Engine`, with a `SwapPoint` between decode steps);
* ``batching``: the batching front (`rlbus.engines.batching.BatchingEngine`) that merges concurrent episodes'
  decode calls;
* `Served.follow`: the `WeightSync` that follows the trainer's versions and swaps each one in at a step
  boundary, setting the version the engine stamps its tokens with inside the swap.

It also says which Python environment it runs in: `EngineKind.python` (vLLM: ``.venv-vllm``, so ``rlbus up``
starts its rollout workers with that interpreter, `rlbus.launch.processes.engine_rlbus_command`) and
`EngineKind.available` (whether this process can run it: ``rlbus demo`` re-runs itself in the engine's
environment when not).

Built in: ``torch`` (`rlbus.engines.torch_kind`) and ``vllm`` (`rlbus.engines.vllm_kind`), registered by import
path, so checking a run config's ``[rollout] engine`` imports neither torch nor vLLM. A user's kind is an
``rlbus.engines`` entry point or ``"package.module:Engine"``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.registry import Registry, subclass_check

if TYPE_CHECKING:
    import torch

    from rlbus.blobs.base import BlobStore
    from rlbus.bus.base import Bus
    from rlbus.engines.batching import BatchingEngine
    from rlbus.models.kinds import Model, ModelSource
    from rlbus.weights.sync import WeightSync

#: Runs inside each swap, once the engine serves the new version: ``on_swap(version, weights)``.
OnSwap = Callable[[int, "Model"], None]


class Served(abc.ABC):
    """What an engine kind builds from a model (see the module docstring)."""

    weights: Model
    #: The engine that generates: its ``policy_version`` is the version its tokens are stamped with.
    engine: Any
    batching: BatchingEngine

    @abc.abstractmethod
    def follow(
        self, *, bus: Bus, store: BlobStore, model_id: str, worker_id: str, on_swap: OnSwap | None = None
    ) -> WeightSync:
        """A weight sync (not started) that follows the trainer's versions of ``model_id`` and swaps each into
        the engine between decode steps; ``on_swap`` runs inside the swap, after the engine's version is set."""


class EngineKind(abc.ABC):
    """One kind of inference engine (see the module docstring); stateless, made by `engine_kind`."""

    @abc.abstractmethod
    def serve(
        self,
        model: ModelSource | Model,
        *,
        seed: int = 0,
        initial: Mapping[str, torch.Tensor] | None = None,
        max_batch: int = 32,
        batch_window_s: float = 0.005,
        prefix_cache_tokens: int = 0,
        options: Mapping[str, Any] | None = None,
    ) -> Served:
        """``model`` served: a source built afresh (or a model in memory, copied) in the inference dtype, with
        ``initial`` (weights in any float dtype) in place of its own, sampling from ``seed``; at most
        ``max_batch`` rows in flight, concurrent calls gathered for ``batch_window_s``; ``prefix_cache_tokens``
        for an engine that caches prefixes on request (0: none). ``options`` are the kind's own keyword
        options; a kind refuses a model it cannot serve with a ConfigError naming ``rollout.engine``."""

    def python(self) -> Path | None:
        """The interpreter of the Python environment this engine must run in; None: any that runs rlbus."""
        return None

    def available(self) -> bool:
        """Whether this process can run the engine (its libraries import here)."""
        return True


#: The engine kinds by name (`rlbus.registry`): ``[rollout] engine``.
ENGINES: Registry[type[EngineKind]] = Registry(
    "engine", group="rlbus.engines", field="rollout.engine", example="Engine",
    check=subclass_check(EngineKind, "an engine kind (a subclass of rlbus.engines.kinds.EngineKind)"),
)
ENGINES.register("torch", "rlbus.engines.torch_kind:TorchKind")
ENGINES.register("vllm", "rlbus.engines.vllm_kind:VLLMKind")


def engine_kind(name: str, *, field: str | None = None) -> EngineKind:
    """The engine kind ``name`` stands for (`ENGINES`); ConfigError names ``field`` (``rollout.engine``)."""
    return ENGINES.get(name, field=field)()
