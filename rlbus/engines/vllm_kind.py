"""The ``vllm`` engine kind: vLLM over the model's directory, in vLLM's own Python environment.

vLLM loads a Hugging Face model directory itself (`rlbus.engines.vllm_engine.VLLMEngine`), so it serves a model
source that has one (``[model] kind = "hf"``). Beside it the stack keeps a bf16 copy in the trainer's tensor
names — the mirror weight sync stages each version's delta against — and hands vLLM the mirror once at the
start (both then hold the same bits) and, inside each swap, the tensors that changed
(`rlbus.engines.vllm_sync`). Its options go to `VLLMEngine` (``llm_kwargs``, ``push_mode`` …).

vLLM lives in its own environment (``make vllm-env`` → ``.venv-vllm``; ``RLBUS_VLLM_PYTHON`` overrides): that
is the interpreter ``rlbus up`` starts rollout workers with, and the one ``rlbus demo --engine vllm`` re-runs
itself under when vLLM does not import here. Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.engines.kinds import EngineKind, OnSwap, Served
from rlbus.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from rlbus.blobs.base import BlobStore
    from rlbus.bus.base import Bus
    from rlbus.engines.batching import BatchingEngine
    from rlbus.engines.vllm_engine import VLLMEngine
    from rlbus.engines.vllm_sync import VLLMWeightSync
    from rlbus.models.kinds import Model, ModelSource


@dataclass
class VLLMStack(Served):
    """vLLM, the bf16 mirror it is kept equal to, and the batching front over vLLM."""

    weights: Model
    engine: VLLMEngine
    batching: BatchingEngine

    def follow(
        self, *, bus: Bus, store: BlobStore, model_id: str, worker_id: str, on_swap: OnSwap | None = None
    ) -> VLLMWeightSync:
        """The `VLLMWeightSync` that stages against the mirror; inside each swap (the mirror then holds the new
        version) it pushes the version's changes into vLLM, then runs ``on_swap``."""
        from rlbus.engines.vllm_sync import VLLMWeightSync, push_staged
        from rlbus.weights.sync import bind_module, live_state

        weights, engine = self.weights, self.engine
        sync: VLLMWeightSync | None = None

        def swapped(version: int) -> None:  # inside the swap: the mirror holds ``version``; now vLLM
            assert sync is not None
            push_staged(engine, live_state(weights), sync.staged, version)
            if on_swap is not None:
                on_swap(version, weights)

        sync = VLLMWeightSync(engine=engine, bus=bus, store=store, state=live_state(weights),
                              bind=bind_module(weights), swap=engine.swap_point.apply, on_swap=swapped,
                              model_id=model_id, worker_id=worker_id)
        return sync


class VLLMKind(EngineKind):
    """``engine = "vllm"``."""

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
    ) -> VLLMStack:
        """``prefix_cache_tokens`` is the torch engine's: vLLM caches prefixes itself."""
        from rlbus.engines.batching import BatchingEngine
        from rlbus.engines.torch_stack import inference_copy
        from rlbus.engines.vllm_engine import VLLMEngine
        from rlbus.weights.sync import live_state

        directory = getattr(model, "directory", None)
        if directory is None:
            raise ConfigError("rollout.engine", "engine = \"vllm\" needs a Hugging Face model ([model] name, path or "
                              "gguf)")
        weights = inference_copy(model, initial=initial)
        engine = VLLMEngine(directory, seed=seed, max_batch=max_batch, **dict(options or {}))
        # vLLM loaded the directory itself; hand it the mirror once, so both hold the same bits from the start
        # and the extension holds what it was given (its digest).
        engine.push(live_state(weights), version=0)
        return VLLMStack(weights=weights, engine=engine,
                         batching=BatchingEngine(engine, max_batch=max_batch, window_s=batch_window_s))

    def python(self) -> Path:
        """``RLBUS_VLLM_PYTHON``, else the checkout's ``.venv-vllm`` (`rlbus.engines.vllm_engine.vllm_python`);
        ConfigError naming ``make vllm-env`` when it does not exist."""
        from rlbus.engines.vllm_engine import vllm_python

        python = vllm_python()
        if not python.exists():
            raise ConfigError("rollout.engine", f"engine = \"vllm\" runs with {python}, which does not exist: run "
                              "`make vllm-env` (or set RLBUS_VLLM_PYTHON)")
        return python

    def available(self) -> bool:
        return importlib.util.find_spec("vllm") is not None
