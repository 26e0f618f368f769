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

from collections.abc import Iterator, Mapping
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


@dataclass
class Features:
    """A training forward's output before the vocabulary projection (what chunked log-probs consume)."""

    hidden: torch.Tensor
    """[B, T, D] final hidden states (after the last norm): logits = hidden @ output_weight().T."""
    routed_experts: torch.Tensor | None = None
    """[L_moe, B, T, k] int64: the model's own top-k experts; None if dense."""
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
        logits_to_keep: int = 0,
    ) -> LMOutput:
        """Run the new ids ``idx`` [B, T] on top of ``cache``. ``logits_to_keep = n > 0`` returns logits for the
        last n positions only ([B, n, V]): a prefill needs one row of a 49 k-wide vocabulary, not T."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The live weight tensors: writing into them in place changes what the model computes."""
        ...


class TrainableLM(Protocol):
    """What the trainer, SFT, checkpoints and weight publishing need from a model (an ``nn.Module``).

    Implemented by the in-repo `Policy` and by `rlbus.models.hf.HFCausalLM`. The trainer never asks for
    full logits: it takes `features` and projects them onto `output_weight` a chunk of positions at a time
    (`rlbus.rl.logprobs.chunked_token_logprobs`), so no fp32 [B, S, V] tensor exists (V is 49 k for
    SmolLM2, 150 k for Qwen).
    """

    @property
    def is_moe(self) -> bool:
        """True when the model routes tokens to experts (router replay and flip rates apply)."""
        ...

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the model is meant to handle (the trainer refuses longer rollouts on arrival)."""
        ...

    def features(
        self, idx: torch.Tensor, *, key_mask: torch.Tensor | None = None, routed_experts: torch.Tensor | None = None
    ) -> Features:
        """Hidden states of a full (uncached) forward over ``idx`` [B, T]; ``routed_experts`` replays routing."""
        ...

    def output_weight(self) -> torch.Tensor:
        """[V, D] the vocabulary projection (tied to the input embedding or not)."""
        ...

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in backward instead of keeping them (memory for compute)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What rebuilds this model's architecture (`rlbus.models.sources.model_from_description`)."""
        ...

    # nn.Module's own API, as the trainer uses it
    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


def weight_tensors(model: torch.nn.Module | TrainableLM) -> dict[str, torch.Tensor]:
    """The model's weights as weight sync ships them: parameters only (buffers such as RoPE tables are
    rebuilt by every copy), each tied tensor once under its first name (a tied embedding/LM head is one
    tensor, so a delta carries it once). The tensors share storage with the model."""
    return {name: p.detach() for name, p in model.named_parameters()}
