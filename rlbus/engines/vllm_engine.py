"""The `Engine` interface over vLLM's offline API, for GPU rollout workers (the ``gpu`` extra).

Importing this module does not import vLLM; constructing `VLLMEngine` does, and raises `ConfigError` with
an install hint when vLLM is missing, so CPU-only roles and tests can import the engines package freely.

How the contract of `rlbus.engines.base` maps onto vLLM (≥ 0.10.2 for ``logprobs_mode``; routed experts
need a vLLM with ``enable_return_routed_experts``):

* **Processed log-probs.** The engine is built with ``logprobs_mode="processed_logprobs"`` and every request
  asks for ``logprobs=0`` (the sampled token only). vLLM then reports log-probs after temperature and
  top-k/top-p processing — the distribution the token was drawn from, as `LogprobSpec` promises. (vLLM's
  default, ``raw_logprobs``, would report the untempered, untruncated model distribution instead.)
  Greedy requests (temperature 0) report 0.0, the log-prob of a point mass, as the torch engine does.
* **Prompts as ids.** Requests go in as ``TokensPrompt(prompt_token_ids=...)``; the ids the trainer sees are
  exactly the ids that were run.
* **Routed experts.** With ``record_experts=True`` the engine passes ``enable_return_routed_experts=True``;
  vLLM returns ``CompletionOutput.routed_experts`` [P + N − 1, L, k] (every input token: the prompt and all
  generated tokens but the last), transposed here to `GenerationResult`'s [L, P + N − 1, k].
* **Weight updates.** vLLM's workers may live in other processes, so tensors travel through
  ``LLM.collective_rpc`` to `WeightLoaderExtension.rlbus_load_weights`, a method mixed into each worker via
  ``worker_extension_cls``; it calls the model's own ``load_weights``, which takes checkpoint (Hugging Face)
  names and handles vLLM's fused/sharded layouts. The prefix cache is then reset: cached KV blocks were
  computed by the old weights.
* **Swap timing.** ``LLM.generate`` is synchronous and cannot pause mid-batch, so updates wait for the
  running call to return (a lock serialises them) and all tokens of one call carry one policy version.
  In-flight, mid-sequence swaps are a `TorchEngine` feature (or need vLLM's async engine).

Not exercised in this repository's CI (no GPU, no vLLM): `tests/unit/engines/test_vllm_engine.py` runs
only where vLLM imports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlbus.engines.base import FinishReason, GenerationRequest, GenerationResult, LogprobSpec
from rlbus.errors import ConfigError

WORKER_EXTENSION = "rlbus.engines.vllm_engine.WeightLoaderExtension"


class WeightLoaderExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); runs inside the worker process."""

    model_runner: Any

    def rlbus_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        device = next(self.model_runner.model.parameters()).device
        self.model_runner.model.load_weights(weights=[(n, t.to(device)) for n, t in weights])


class VLLMEngine:
    """`rlbus.engines.base.Engine` backed by ``vllm.LLM``."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        policy_version: int = 0,
        record_experts: bool = False,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """``model`` is a local Hugging Face model directory; ``llm_kwargs`` go to ``vllm.LLM`` verbatim."""
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ConfigError(
                "engine", "the vLLM engine needs the 'vllm' package (install rlbus with the 'gpu' extra)"
            ) from exc
        kwargs: dict[str, Any] = {
            "model": str(model),
            "dtype": dtype,
            "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if record_experts:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(llm_kwargs or {})
        self._llm = LLM(**kwargs)
        self.policy_version = policy_version
        self.record_experts = record_experts
        self._lock = threading.Lock()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=1,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,  # 0 = off, as in GenerationRequest
                max_tokens=r.max_new_tokens,
                stop=list(r.stop) or None,
                stop_token_ids=list(r.stop_token_ids) or None,
                seed=r.seed,
                logprobs=0,
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        with self._lock:
            version = self.policy_version
            started = time.perf_counter()
            outputs = self._llm.generate(prompts, sampling_params=params, use_tqdm=False)
            elapsed = time.perf_counter() - started
        return [self._result(r, o, version, elapsed) for r, o in zip(requests, outputs, strict=True)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Send ``weights`` (checkpoint names) to every worker, reset the prefix cache, set the version."""
        payload = [(name, t.detach().cpu()) for name, t in weights]
        with self._lock:
            self._llm.collective_rpc("rlbus_load_weights", args=(payload,))
            self._llm.reset_prefix_cache()
            self.policy_version = version

    def _result(self, req: GenerationRequest, out: Any, version: int, elapsed: float) -> GenerationResult:
        completion = out.outputs[0]
        token_ids = tuple(int(t) for t in completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError("vLLM returned no per-token log-probs although logprobs=0 was requested")
        logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, completion.logprobs, strict=True)]
        if req.temperature == 0:
            # Greedy: the sampled distribution is a point mass (see LogprobSpec); vLLM's processed mode
            # reports the untempered softmax there instead, so state the exact value.
            logprobs = [0.0] * len(token_ids)
        if completion.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")
        finish: FinishReason = "length" if completion.finish_reason == "length" else "stop"
        routed = getattr(completion, "routed_experts", None)
        experts = None
        if routed is not None:
            experts = torch.as_tensor(routed).permute(1, 0, 2).to(torch.int16).contiguous()  # [L, T, k]
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=tuple(req.prompt_ids),
            token_ids=token_ids,
            logprobs=torch.tensor(logprobs, dtype=torch.float32),
            policy_versions=(version,) * len(token_ids),
            text=completion.text or "",
            finish_reason=finish,
            logprob_spec=LogprobSpec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            routed_experts=experts,
            extra={"engine": "vllm", "batch_seconds": elapsed},
        )
