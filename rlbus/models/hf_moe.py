"""Router recording and replay for Hugging Face MoE models (Qwen3-MoE, OLMoE, Mixtral, …).

`RouterTap.attach(model)` finds the model's MoE routers; None for a dense model. A forward runs inside
``with tap.session(replay=..., token_mask=...) as record:``; afterwards ``record.experts`` holds the
model's own top-k experts per MoE layer and token [L, B, T, k] and ``record.aux_loss`` the balancing loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RouterRecord:
    """What one forward's routers did."""

    experts: torch.Tensor | None = None
    """[L, B, T, k] int64: each MoE layer's own top-k experts per token (even under replay)."""
    aux_loss: torch.Tensor | None = None
    """Scalar balancing loss with the model's coefficient applied; None for a dense model."""


class RouterTap:
    """The MoE routers of one HF model (see the module docstring)."""

    @classmethod
    def attach(cls, model: Any) -> RouterTap | None:
        """None for a dense model."""
        return None

    @staticmethod
    @contextmanager
    def none() -> Iterator[RouterRecord]:
        """The session of a dense model: nothing recorded."""
        yield RouterRecord()

    @contextmanager
    def session(self, *, replay: torch.Tensor | None, token_mask: torch.Tensor | None) -> Iterator[RouterRecord]:
        raise NotImplementedError
        yield RouterRecord()
