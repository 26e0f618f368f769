"""Router recording and replay for Hugging Face MoE models (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral).

`RouterTap.attach(model)` finds the model's MoE routers; None for a dense model, a `ConfigError` for an MoE
whose routers it does not know. A forward runs inside ``with tap.session(replay=..., token_mask=...) as
record:``; afterwards ``record.experts`` holds the model's own top-k experts per MoE layer and token
[L, B, T, k] and ``record.aux_loss`` the balancing loss.

How it taps. In transformers 5.x these families share one router contract: the sparse block flattens its
input to [N = B·T, C] and calls ``block.gate`` (a ``*TopKRouter``), which returns ``(router_logits [N, E],
routing_weights [N, k], selected_experts [N, k])``; the block hands the last two to its experts. A forward
pre-hook on the block notes (B, T); a forward hook on the router records ``selected_experts`` and, under
replay, returns the replayed ids S with the weights recomputed from the router's *own* logits z exactly as
the family does:

    w = softmax(z)[S]  (softmax over all E experts, in float32),   w ← w / Σ_S w  iff the family renormalises

(Qwen3-MoE, Qwen2-MoE, OLMoE: ``norm_topk_prob``; Mixtral: always), cast to the dtype of the router's own
weights. So replaying the router's own choice reproduces its output bit for bit, and the router keeps its
gradient through z for the replayed experts (rlbus's `Policy` does the same, see rlbus/models/policy.py).

Balancing loss: the Switch loss as `Policy` computes it, per MoE layer over the N real tokens of the call
(``token_mask`` excludes padding), with S the experts actually used (the replayed ones under replay):

    aux = E · Σ_e f_e · P_e,   f_e = #{(token, slot) sent to e} / (N·k),   P_e = mean_token softmax(z)_e

``aux_loss = config.router_aux_loss_coef · mean over layers of aux``; f is a count, the gradient flows
through P.

Gradient checkpointing recomputes each layer in backward, after the session has ended, and the recompute
must route like the forward did, and redo the same aux-loss ops (the checkpoint checks that it saves the
same tensors). A session with autograd on therefore leaves its replayed experts and token mask armed for
recomputation until the next session starts; outside a session the hooks apply them (when the token count
matches) and record nothing. Without replay the recompute finds the same top-k by itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from rlbus.errors import ConfigError

RENORMALISE: dict[str, str | bool] = {
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": True,
}
"""Router class → whether its top-k weights are renormalised (True) or the router attribute that says so."""

_MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class RouterRecord:
    """What one forward's routers did."""

    experts: torch.Tensor | None = None
    """[L, B, T, k] int64: each MoE layer's own top-k experts per token (even under replay)."""
    aux_loss: torch.Tensor | None = None
    """Scalar balancing loss with the model's coefficient applied; None for a dense model."""


@dataclass
class _Session:
    """The state of one open `RouterTap.session`."""

    replay: torch.Tensor | None  # [L, B, T, k] int64 on the model's device
    token_mask: torch.Tensor | None  # [B, T] bool
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer → (B, T) of its block input
    own: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → [B, T, k]
    aux: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → scalar
    armed: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=dict)
    """layer → (replayed experts [N, k] | None, token mask [N] | None), kept for checkpoint recomputation."""


class RouterTap:
    """The MoE routers of one HF model (see the module docstring)."""

    def __init__(self, routers: list[Any], blocks: list[torch.nn.Module], aux_coef: float) -> None:
        """``routers``: the HF ``*TopKRouter`` modules in layer order; ``blocks``: the sparse blocks holding them."""
        self.routers = routers
        self.num_experts = int(routers[0].num_experts)
        self.top_k = int(routers[0].top_k)
        self.aux_coef = aux_coef
        self._renorm = [_renormalises(r) for r in routers]
        self._active: _Session | None = None
        self._recompute: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}  # `_Session.armed`
        for layer, (router, block) in enumerate(zip(routers, blocks, strict=True)):
            # Bound methods in partials, not closures: `copy.deepcopy` of the model rebinds them to the copy's tap.
            block.register_forward_pre_hook(partial(self._on_block, layer), with_kwargs=True)
            router.register_forward_hook(partial(self._on_router, layer))

    @classmethod
    def attach(cls, model: Any) -> RouterTap | None:
        """Hook every MoE router of ``model``; None for a dense model."""
        routers: list[Any] = []
        blocks, others = [], []
        for module in model.modules():
            gate = getattr(module, "gate", None)
            if isinstance(gate, torch.nn.Module) and type(gate).__name__ in RENORMALISE:
                routers.append(gate)
                blocks.append(module)
            else:
                others.append(module)
        unknown = {type(m).__name__ for m in others if _looks_like_moe(type(m).__name__)}
        config = getattr(model, "config", None)
        declared = any(int(getattr(config, f, 0) or 0) > 0 for f in _MOE_CONFIG_FIELDS)
        if unknown or (declared and not routers):
            raise ConfigError(
                "model",
                f"{type(model).__name__} is a mixture-of-experts model whose routers rlbus cannot tap "
                f"({', '.join(sorted(unknown)) or 'none found'}); supported: {', '.join(RENORMALISE)}",
            )
        if not routers:
            return None
        shapes = {(int(r.num_experts), int(r.top_k)) for r in routers}
        if len(shapes) != 1:
            raise ConfigError("model", f"MoE layers disagree on (experts, top-k): {sorted(shapes)}")
        return cls(routers, blocks, float(getattr(config, "router_aux_loss_coef", 0.0)))

    @staticmethod
    @contextmanager
    def none() -> Iterator[RouterRecord]:
        """The session of a dense model: nothing recorded."""
        yield RouterRecord()

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def session(self, *, replay: torch.Tensor | None, token_mask: torch.Tensor | None) -> Iterator[RouterRecord]:
        """Record (and with ``replay`` [L, B, T, k], replay) the routing of the forward run inside."""
        if self._active is not None:
            raise RuntimeError("a RouterTap session is already open")
        device = self.routers[0].weight.device
        if replay is not None:
            replay = self._checked(replay).to(device=device, dtype=torch.long)
        mask = None if token_mask is None else token_mask.to(device=device, dtype=torch.bool)
        state = _Session(replay=replay, token_mask=mask)
        self._recompute = {}
        self._active = state
        record = RouterRecord()
        try:
            yield record
        finally:
            self._active = None
        if len(state.own) != self.num_layers:
            raise RuntimeError(f"{len(state.own)} of {self.num_layers} MoE layers ran inside the session")
        if torch.is_grad_enabled():
            self._recompute = state.armed
        record.experts = torch.stack([state.own[i] for i in range(self.num_layers)])  # [L, B, T, k]
        aux = torch.stack([state.aux[i] for i in range(self.num_layers)])  # [L]
        record.aux_loss = self.aux_coef * aux.mean()

    def _checked(self, replay: torch.Tensor) -> torch.Tensor:
        L, k, E = self.num_layers, self.top_k, self.num_experts
        if replay.dim() != 4 or replay.shape[0] != L or replay.shape[3] != k:
            raise ValueError(f"routed_experts must be [L, B, T, k] with L = {L}, k = {k}; got {tuple(replay.shape)}")
        if replay.numel() and (int(replay.min()) < 0 or int(replay.max()) >= E):
            raise ValueError(f"routed_experts ids must be in [0, {E})")
        return replay

    def _on_block(self, layer: int, block: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = self._active
        if state is None:
            return
        hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, C]
        B, T = hidden.shape[:2]
        if state.replay is not None and tuple(state.replay.shape[1:3]) != (B, T):
            raise ValueError(f"routed_experts cover [B, T] = {tuple(state.replay.shape[1:3])}; "
                             f"the forward runs {(B, T)}")
        if state.token_mask is not None and tuple(state.token_mask.shape) != (B, T):
            raise ValueError(f"token mask is {tuple(state.token_mask.shape)}; the forward runs {(B, T)}")
        state.shapes[layer] = (B, T)

    def _on_router(self, layer: int, router: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        logits, weights, own = output  # [N, E], [N, k], [N, k]
        N, k = own.shape
        state = self._active
        if state is None:  # outside a session: a checkpointed layer's recompute in backward, or plain use
            armed = self._recompute.get(layer)
            if armed is None or any(t is not None and t.shape[0] != N for t in armed):
                return None
            replayed, mask = armed
        else:
            replayed = None if state.replay is None else state.replay[layer].reshape(N, k)  # [N, k]
            mask = None if state.token_mask is None else state.token_mask.reshape(N)  # [N]
        chosen = own
        if replayed is not None:
            chosen, weights = replayed, _replayed_weights(logits, replayed, self._renorm[layer], weights.dtype)
        # Also on recompute (its result unused there): the checkpoint checks the same tensors are saved.
        aux = switch_aux(logits, chosen, mask, self.num_experts)
        if state is not None:
            B, T = state.shapes[layer]
            state.own[layer] = own.view(B, T, k)
            state.aux[layer] = aux
            state.armed[layer] = (replayed, mask)
        return logits, weights, chosen


def _looks_like_moe(name: str) -> bool:
    """A router or sparse-block class name (``…Router``, ``…SparseMoeBlock``, ``…MoE``) outside `RENORMALISE`."""
    low = name.lower()
    return name not in RENORMALISE and ("router" in low or "sparsemoe" in low or low.endswith(("moeblock", "moe")))


def _renormalises(router: torch.nn.Module) -> bool:
    rule = RENORMALISE[type(router).__name__]
    return rule if isinstance(rule, bool) else bool(getattr(router, rule))


def _replayed_weights(logits: torch.Tensor, chosen: torch.Tensor, renorm: bool, dtype: torch.dtype) -> torch.Tensor:
    """The family's routing weights [N, k] at the experts ``chosen`` [N, k], from the router logits [N, E]."""
    w = F.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)  # [N, k]
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(dtype)


def switch_aux(logits: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """One layer's Switch loss E · Σ_e f_e P_e over the tokens where ``mask`` [N] is True (all if None)."""
    N, k = chosen.shape
    w = torch.ones(N, device=logits.device) if mask is None else mask.float()  # [N]
    n_tok = w.sum().clamp(min=1.0)
    dispatched = F.one_hot(chosen, num_experts).sum(1).float()  # [N, E] slots of each token sent to e
    f = (dispatched * w[:, None]).sum(0) / (n_tok * k)  # [E] fraction of dispatched slots
    p = (F.softmax(logits.float(), dim=-1) * w[:, None]).sum(0) / n_tok  # [E] mean router probability
    return num_experts * (f * p).sum()
