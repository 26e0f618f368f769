"""Any Hugging Face ``transformers`` causal LM behind rlbus's model protocols, for inference and training.

The engine speaks `rlbus.models.base.CausalLM`: new ids + per-row positions + key-padding mask + cache →
logits. A ``transformers`` causal LM already does exactly that through ``input_ids``, ``position_ids``,
``attention_mask`` (covering cached + new tokens) and its cache object, so the adapter only renames
arguments and casts logits to float32 for the sampler. The trainer speaks `TrainableLM`: `features` runs the
decoder without its LM head (the trainer projects hidden states onto `output_weight` in chunks, so the
[B, S, V] logits never exist), `set_gradient_checkpointing` uses transformers' own per-layer checkpointing.

The adapter is an ``nn.Module`` holding the HF model as ``hf``, but its `state_dict` / `load_state_dict`
are the HF model's own (no wrapper prefix), so a checkpoint or a weight manifest names tensors exactly as
the model's safetensors do. A tied embedding / LM head is one parameter; `rlbus.models.base.weight_tensors`
lists it once, under ``model.embed_tokens.weight``. On N trainer ranks the wrapper is the FSDP root and
``hf`` is what checkpoints name tensors by (`rlbus.training.ranks.state_module`), so the names stay these.

MoE families (Qwen3-MoE, OLMoE, Mixtral, …) get router recording and replay from
`rlbus.models.hf_moe.RouterTap`: the engine records each token's top-k experts, the trainer routes the same
tokens to the same experts.

Models are loaded from a local directory only (``local_files_only=True``): workers never reach a model hub
at run time; `rlbus.models.sources` turns a shipped name or a GGUF file into such a directory once.
``transformers`` is imported lazily, so importing this module costs nothing for roles that do not use it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlbus.errors import ConfigError
from rlbus.models.base import Features, LMOutput
from rlbus.models.hf_moe import RouterTap

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HFCausalLM(torch.nn.Module):
    """A ``transformers`` causal LM behind `CausalLM` and `TrainableLM`; wraps, never copies, the model."""

    def __init__(self, model: PreTrainedModel, *, source: Mapping[str, Any] | None = None) -> None:
        """``source`` describes where the model came from (kept in checkpoints: `describe`)."""
        super().__init__()
        self.hf = model.eval()
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self._source = dict(source or {})
        self.router = RouterTap.attach(model)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> HFCausalLM:
        """Load ``AutoModelForCausalLM`` from a local directory (config + weights, no hub access)."""
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise ConfigError("model", "the Hugging Face adapter needs the 'transformers' package") from exc
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError("model.path", f"{path} has no config.json: not a Hugging Face model directory")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        # transformers' decorator on `.to` hides nn.Module's signature from mypy; the call is nn.Module.to.
        model.to(torch.device(device))  # type: ignore[arg-type]
        return cls(model, source={"kind": "hf", "path": str(path)})

    @classmethod
    def from_config(cls, config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> HFCausalLM:
        """A randomly initialised model of a ``transformers`` config (tests and benches: no weights to ship)."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return cls(model, source={"kind": "hf", "config": config.to_dict()})

    # -- CausalLM (the engine) ------------------------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        return int(self.hf.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return self.hf.device

    @property
    def vocab_size(self) -> int:
        return int(self.hf.config.vocab_size)

    def new_cache(self, batch: int, max_len: int) -> Any:
        """A fresh ``DynamicCache``; it grows as needed, so ``batch``/``max_len`` are only upper bounds."""
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    def forward(
        self,
        idx: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: Any = None,
        routed_experts: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> LMOutput:
        token_mask = None if key_mask is None else key_mask[:, -idx.shape[1] :]
        with self._routing(routed_experts, token_mask) as record:
            out = self.hf(
                input_ids=idx,
                attention_mask=None if key_mask is None else key_mask.long(),
                position_ids=positions,
                use_cache=cache is not None,
                **{self._cache_kw: cache},
                **({"logits_to_keep": logits_to_keep} if logits_to_keep and self._keeps_logits else {}),
            )
        logits = out.logits if not logits_to_keep or self._keeps_logits else out.logits[:, -logits_to_keep:]
        new_cache = out["cache"] if "cache" in out else out.get("past_key_values")
        return LMOutput(logits=logits.float(), cache=new_cache, routed_experts=record.experts,
                        aux_loss=record.aux_loss)

    # -- TrainableLM (the trainer) --------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def features(
        self, idx: torch.Tensor, *, key_mask: torch.Tensor | None = None, routed_experts: torch.Tensor | None = None
    ) -> Features:
        """The decoder's final hidden states for a right-padded batch (positions 0.. per row)."""
        decoder = self.hf.get_decoder()
        with self._routing(routed_experts, key_mask) as record:
            out = decoder(
                input_ids=idx, attention_mask=None if key_mask is None else key_mask.long(), use_cache=False
            )
        return Features(hidden=out.last_hidden_state, routed_experts=record.experts, aux_loss=record.aux_loss)

    def output_weight(self) -> torch.Tensor:
        head = self.hf.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise ConfigError("model", f"{type(self.hf).__name__} has no bias-free linear LM head")
        weight: torch.Tensor = head.weight
        return weight

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn)
        if hasattr(self.hf, "activation_checkpointing_enable"):
            if enabled:
                self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.hf.activation_checkpointing_disable()
        elif enabled:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf.gradient_checkpointing_disable()

    def describe(self) -> dict[str, Any]:
        """Where the weights came from: ``{"kind": "hf", "path": DIR}`` or ``{"kind": "hf", "config": {...}}``."""
        return dict(self._source) or {"kind": "hf", "config": self.hf.config.to_dict()}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- state: the HF model's own names --------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped model's live tensors (no wrapper prefix), so names match the checkpoint."""
        return self.hf.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.hf.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Any:
        return self.hf.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _routing(self, replay: torch.Tensor | None, token_mask: torch.Tensor | None) -> Any:
        if self.router is None:
            if replay is not None:
                raise ValueError(f"routed_experts given but {type(self.hf).__name__} has no MoE layers")
            return RouterTap.none()
        return self.router.session(replay=replay, token_mask=token_mask)
