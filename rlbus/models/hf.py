"""Adapter that lets the torch engine drive any Hugging Face ``transformers`` causal LM.

The engine speaks `rlbus.models.base.CausalLM`: new ids + per-row positions + key-padding mask + cache →
logits. A ``transformers`` causal LM already does exactly that through ``input_ids``, ``position_ids``,
``attention_mask`` (covering cached + new tokens) and its cache object, so the adapter only renames
arguments, hides the cache keyword's spelling (``cache`` in transformers 5, ``past_key_values`` before)
and casts logits to float32 for the sampler.

Models are loaded from a local directory only (``local_files_only=True``): workers never reach a model
hub at run time; weights arrive as files or through rlbus weight sync. ``transformers`` is imported
lazily, so importing this module costs nothing for roles that do not use it.

Routed experts are not reported (``LMOutput.routed_experts`` is None): HF MoE implementations differ in
how they expose router logits, and router replay is supported on the in-repo `Policy`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlbus.errors import ConfigError
from rlbus.models.base import LMOutput

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HFCausalLM:
    """A ``transformers`` causal LM behind the `CausalLM` interface; wraps, never copies, the model."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> HFCausalLM:
        """Load ``AutoModelForCausalLM`` from a local directory (config + weights, no hub access)."""
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise ConfigError("model", "the Hugging Face adapter needs the 'transformers' package") from exc
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        # transformers' decorator on `.to` hides nn.Module's signature from mypy; the call is nn.Module.to.
        model.to(torch.device(device))  # type: ignore[arg-type]
        return cls(model)

    @property
    def max_seq_len(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, batch: int, max_len: int) -> Any:
        """A fresh ``DynamicCache``; it grows as needed, so ``batch``/``max_len`` are only upper bounds."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(
        self,
        idx: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> LMOutput:
        kwargs: dict[str, Any] = {self._cache_kw: cache}
        out = self.model(
            input_ids=idx,
            attention_mask=None if key_mask is None else key_mask.long(),
            position_ids=positions,
            use_cache=cache is not None,
            **kwargs,
        )
        new_cache = out["cache"] if "cache" in out else out.get("past_key_values")
        return LMOutput(logits=out.logits.float(), cache=new_cache)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped model's live tensors (no wrapper prefix), so names match the checkpoint."""
        return self.model.state_dict()
