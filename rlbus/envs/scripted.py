"""`ScriptedEngine`: an `Engine` that "samples" predetermined turns, for reference solutions and tests.

Playing a task's reference turns through the real harness yields warm-start episodes with exactly the
token layout of policy rollouts (headers, masks, observations from the live world). Each turn is sampled
with certainty, so its log-probs are 0; the engine honours ``max_new_tokens`` (finish ``length``) and
appends the request's first stop token id (EOS) when there is room, as a real engine would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch

from rlbus.engines.base import GenerationRequest, GenerationResult, LogprobSpec
from rlbus.envs.chat import Tokenizer


class ScriptedEngine:
    """Replays ``turns`` in order, one per request; raises when the script runs out."""

    def __init__(self, turns: Iterable[str | Sequence[int]], *, tokenizer: Tokenizer, policy_version: int = 0) -> None:
        self.tokenizer = tokenizer
        self._turns: deque[str | Sequence[int]] = deque(turns)
        self._version = policy_version
        self.requests: list[GenerationRequest] = []

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def remaining(self) -> int:
        return len(self._turns)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return [self._one(r) for r in requests]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """A script has no weights; only the version moves (tests of version bookkeeping use it)."""
        for _ in weights:
            pass
        self._version = version

    def _one(self, request: GenerationRequest) -> GenerationResult:
        if not self._turns:
            raise RuntimeError(f"scripted engine has no turn left for request {len(self.requests) + 1}")
        self.requests.append(request)
        turn = self._turns.popleft()
        ids = self.tokenizer.encode(turn) if isinstance(turn, str) else list(turn)
        ids, finish = ids[: request.max_new_tokens], "length"
        if len(ids) < request.max_new_tokens:
            finish = "stop"
            ids += list(request.stop_token_ids[:1])
        stops = set(request.stop_token_ids)
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=tuple(ids),
            logprobs=torch.zeros(len(ids), dtype=torch.float32),
            policy_versions=(self._version,) * len(ids),
            text=self.tokenizer.decode([i for i in ids if i not in stops]),
            finish_reason="stop" if finish == "stop" else "length",
            logprob_spec=LogprobSpec(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k),
        )
