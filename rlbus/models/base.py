"""The minimal causal-LM interface an inference engine drives, and its output record.

Two very different models sit behind it: the in-repo `Policy` (rlbus/models/policy.py) and any Hugging Face
causal LM (rlbus/models/hf.py). The engine only ever needs "run these new ids, at these positions, with
this key-padding mask, on top of this cache → logits (+ routed experts)", so that is all the protocol
asks for. Keeping it structural (a Protocol, no base class) lets the HF adapter stay a thin wrapper.

Conventions shared by every implementation:

* ``idx`` [B, T] are the *new* token ids of this call; earlier ones live in ``cache``.
* ``positions`` [B, T] are per-sequence RoPE positions (left padding makes them differ per row).
* ``key_mask`` [B, S] is True where a key is a real token, for all S = cached + new slots.
* ``cache`` is whatever ``new_cache`` returned (or the previous output's ``cache``); implementations may
  update it in place and return the same object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class LMOutput:
    """One forward call's results."""

    logits: torch.Tensor
    """[B, T, V] float32 next-token logits for every new position."""
    cache: Any
    """The cache to pass to the next call (may be the same object, updated in place)."""
    routed_experts: torch.Tensor | None = None
    """[L_moe, B, T, k] int64: the model's own top-k experts per MoE layer and token; None if dense."""
    aux_loss: torch.Tensor | None = None
    """Scalar MoE load-balancing loss with its coefficient applied; None if the model has none."""


class CausalLM(Protocol):
    """What `rlbus.engines.torch_engine.TorchEngine` needs from a model."""

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + generated tokens) the model is meant to handle."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the model's weights live; inputs and caches are created there."""
        ...

    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty KV cache for ``batch`` rows of at most ``max_len`` slots."""
        ...

    def forward(
        self,
        idx: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> LMOutput:
        """Run the new ids ``idx`` [B, T] on top of ``cache``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The live weight tensors: writing into them in place changes what the model computes."""
        ...
