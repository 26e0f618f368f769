"""The part of the vLLM engine that runs inside vLLM's worker: weight pushes, the received-weights digest.

vLLM mixes `RlbusWorkerExtension` into its worker class (``worker_extension_cls``), so its methods run
where the model lives and the engine reaches them with ``collective_rpc``. Two ways in, one interface
(`rlbus.engines.vllm_engine.VLLMEngine.push`):

* **Whole-tensor reload** (`rlbus_reload`, the CPU path). vLLM's CPU backend prepacks linear weights for
  oneDNN when it loads them and leaves the parameters behind empty, so elements cannot be written in place
  and ``model.load_weights`` alone does not reach the packed copy. The worker's own ``reload_weights``
  runs the loader *and* the post-load processing again for the tensors given. The tensors go in checkpoint
  (Hugging Face) names, the same names the trainer ships; a fused group (q/k/v → ``qkv_proj``, gate/up →
  ``gate_up_proj``) must be sent whole, or the members not sent are re-initialised in the fused tensor
  (`fused_group` says which names travel together). They travel as safetensors bytes: ``collective_rpc``
  may cross a process boundary, where raw tensors arrive as nested lists.
* **In-place scatter** (`rlbus_scatter`, the GPU path). On a GPU the parameters are plain tensors, so only
  the changed elements are written: each checkpoint tensor's flat positions are mapped to its slice of the
  fused vLLM parameter (`VLLM_FUSED`) and scattered on the integer view, bit-exact like
  `rlbus.weights.apply.apply_update_`. Written for CUDA workers; it has not run on a GPU in this
  repository (no GPU here), and the CPU build cannot run it (packed weights).

Either way the extension keeps a *shadow*: the checkpoint-named tensors exactly as received, the proof
object of `rlbus_digest` — the whole-model digest (`rlbus.weights.digest.state_digest`) of what vLLM was
given, which the engine compares with its own copy's and so with the trainer's manifest. vLLM's packed
copy itself cannot be read back on CPU; the tests check it behaviourally (after a delta, vLLM's outputs
equal those of a fresh vLLM started from the target weights).
"""

from __future__ import annotations

import re
from typing import Any

import torch

#: Checkpoint name suffix → (fused vLLM parameter suffix, shard index). A fused parameter stacks its
#: shards along dim 0 in shard order (q, k, v; gate, up), which is how vLLM's Llama/Qwen/Mistral load them.
VLLM_FUSED: dict[str, tuple[str, int]] = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}

_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
_MEMBER = re.compile(r"^(?P<head>.*[._])(?P<member>q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)(?P<tail>[._].*)$")


def fused_group(name: str) -> tuple[str, ...]:
    """The checkpoint names vLLM fuses with ``name`` (``name`` itself first); ``(name,)`` when unfused."""
    m = _MEMBER.match(name)
    if m is None:
        return (name,)
    for group in _GROUPS:
        if m["member"] in group:
            return (name, *(f"{m['head']}{other}{m['tail']}" for other in group if other != m["member"]))
    return (name,)


def with_fused(names: set[str], known: set[str]) -> list[str]:
    """``names`` plus every fused partner that exists in ``known``, sorted (what a reload must send)."""
    out = set(names)
    for name in names:
        out.update(n for n in fused_group(name) if n in known)
    return sorted(out)


class RlbusWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); see the module docstring."""

    model_runner: Any
    reload_weights: Any
    _rlbus_shadow: dict[str, torch.Tensor]

    def _shadow(self) -> dict[str, torch.Tensor]:
        if not hasattr(self, "_rlbus_shadow"):
            self._rlbus_shadow = {}
        return self._rlbus_shadow

    def rlbus_reload(self, blob: bytes) -> int:
        """Load the safetensors ``blob`` (checkpoint names) through the worker's ``reload_weights``;
        returns how many tensors it held."""
        from safetensors.torch import load

        return self._reload(load(blob))

    def rlbus_reload_tensors(self, tensors: dict[str, torch.Tensor]) -> int:
        """`rlbus_reload` for a worker in the caller's process (vLLM's in-process engine core): the tensors
        arrive as objects, so they are copied once (the shadow must not alias the caller's buffers, which
        weight sync rewrites) instead of serialised and parsed."""
        return self._reload({name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()})

    def _reload(self, tensors: dict[str, torch.Tensor]) -> int:
        self.reload_weights(weights_iterator=iter(list(tensors.items())))
        if any("embed_tokens" in name for name in tensors):
            self._retie()
        self._shadow().update(tensors)
        return len(tensors)

    def _retie(self) -> None:
        """A tied LM head is never reloaded itself (the loader skips ``lm_head.weight``), but it keeps
        state derived from the embedding: on CPU a oneDNN-packed copy made after loading, so its logits
        stayed on the old embedding. Tie it again (a reload may re-create the embedding's parameter) and
        redo its post-load processing."""
        model = self.model_runner.get_model()
        if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            return
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return
        if head.weight is not embed.weight:
            head.tie_weights(embed)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

    def rlbus_scatter(self, updates: list[tuple[str, bytes]]) -> int:
        """Write changed elements in place: ``updates`` are (checkpoint name, safetensors bytes holding
        ``positions`` int64 flat indices into that tensor and ``values`` its new elements)."""
        from safetensors.torch import load

        model = self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model
        params = dict(model.named_parameters())
        shadow = self._shadow()
        written = 0
        with torch.no_grad():
            for name, blob in updates:
                payload = load(blob)
                positions, values = payload["positions"], payload["values"]
                target, offset = self._locate(params, name)
                flat = target.view(-1).view(_INT_VIEW[target.element_size()])
                idx = positions.to(target.device) + offset
                flat.index_put_((idx,), values.view(_INT_VIEW[values.element_size()]).to(target.device))
                if name in shadow:
                    sflat = shadow[name].view(-1).view(_INT_VIEW[values.element_size()])
                    sflat.index_put_((positions,), values.view(_INT_VIEW[values.element_size()]))
                written += len(positions)
        return written

    def _locate(self, params: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, int]:
        """The vLLM parameter holding checkpoint tensor ``name`` and the flat offset of its rows there."""
        if name in params:
            return params[name], 0
        for suffix, (fused_suffix, shard) in VLLM_FUSED.items():
            if not name.endswith(suffix):
                continue
            head = name[: -len(suffix)]
            fused = params.get(head + fused_suffix)
            if fused is None:
                break
            shadow = self._shadow()
            members = [n for n, (f, _) in VLLM_FUSED.items() if f == fused_suffix]
            rows = [shadow[head + m].shape[0] if head + m in shadow else 0 for m in members]
            row_len = fused[0].numel() if fused.dim() > 1 else 1
            return fused, sum(rows[:shard]) * row_len
        raise KeyError(f"no vLLM parameter holds {name!r} (the in-place path knows dense Llama-style layouts)")

    def rlbus_digest(self) -> str:
        """`rlbus.weights.digest.state_digest` of the tensors vLLM was given (the shadow)."""
        from rlbus.weights.digest import state_digest

        return state_digest(self._shadow())

    def rlbus_record_routing(self, top_k: int) -> int:
        """Record each MoE layer's top-``top_k`` experts per token from now on (forward hooks on the routers'
        gate modules: their logits' top-k is the experts vLLM's fused MoE picks for softmax top-k routing).
        Returns the number of MoE layers hooked. Tokens are recorded in the order vLLM's forwards feed them,
        so the engine uses it one request at a time with the prefix cache off (`rlbus bench mismatch`)."""
        model = self.model_runner.get_model()
        gates = [m for name, m in model.named_modules() if name.endswith(".gate") and hasattr(m, "weight")]
        self._rlbus_routes: list[list[torch.Tensor]] = [[] for _ in gates]
        for i, gate in enumerate(gates):
            def hook(_mod: Any, _inp: Any, out: Any, i: int = i) -> None:
                logits = out[0] if isinstance(out, tuple) else out
                self._rlbus_routes[i].append(logits.float().topk(top_k, dim=-1).indices.to(torch.int16).cpu())

            gate.register_forward_hook(hook)
        return len(gates)

    def rlbus_take_routing(self) -> bytes:
        """The experts recorded since the last call, as safetensors bytes of ``experts`` [L, T, k]."""
        from safetensors.torch import save

        routes = getattr(self, "_rlbus_routes", [])
        if not routes or not routes[0]:
            return save({"experts": torch.zeros(0, 0, 0, dtype=torch.int16)})
        experts = torch.stack([torch.cat(layer) for layer in routes])  # [L, T, k]
        for layer in routes:
            layer.clear()
        return save({"experts": experts.contiguous()})

    def rlbus_device(self) -> str:
        """Where the model's parameters live (``cpu`` or ``cuda:N``): picks the push path."""
        return str(next(self.model_runner.get_model().parameters()).device)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
