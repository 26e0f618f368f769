"""The ``torch`` engine kind: rlbus's own engine (`rlbus.engines.torch_engine`) in this process.

It serves any model source (the in-house policy, any HF causal LM) or a model in memory through the torch chain
(`rlbus.engines.torch_stack`: a copy in the inference dtype → the torch engine → the batching engine), runs in
the project's own environment, and takes no options. Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlbus.engines.kinds import EngineKind
from rlbus.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from rlbus.engines.torch_stack import TorchStack
    from rlbus.models.kinds import Model, ModelSource


class TorchKind(EngineKind):
    """``engine = "torch"``."""

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
    ) -> TorchStack:
        from rlbus.engines.torch_stack import torch_stack

        if options:
            raise ConfigError("rollout.engine", f"the torch engine takes no options (given {sorted(options)})")
        return torch_stack(model, initial=initial, seed=seed, max_batch=max_batch,
                           prefix_cache_tokens=prefix_cache_tokens, batch_window_s=batch_window_s)
