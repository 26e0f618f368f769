"""What the gateway records of a completion: a `Served` record per choice (``rl.served.v1``), the sampled
turn a session keeps, and the `Rollout` a completion recorded as a rollout becomes (``rl.rollouts.v1``).

The layouts are the contract with the trainer side described in `rlbus.serve.gateway`: token ids, loss
mask (1 exactly on sampled ids), log-probs and token versions as the agent loop lays them out, the
sampling parameters, and routed experts padded to the whole rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlbus.engines.base import GenerationResult
from rlbus.envs.chat import ChatFormat
from rlbus.schemas import AllowedTokens, Rollout, SamplingInfo, Served, ServedParams, TensorData, Turn
from rlbus.serve import api
from rlbus.serve.call import Call
from rlbus.serve.prompt import SampledTurn


def served_record(
    call: Call, i: int, result: GenerationResult, finish: str, *, model_id: str, worker_id: str, region: str,
    clock: Callable[[], float],
) -> Served:
    """Choice ``i`` of a completion as a `Served` record (``clock`` stamps ``created_at``)."""
    req = call.request
    routed = result.routed_experts
    return Served(
        served_id=call.served_id, choice_index=i, request_id=call.request_id, tenant=call.tenant,
        session_id="" if call.session is None else call.session.session_id, user=req.user or "",
        model_id=model_id, model_name=req.model, worker_id=worker_id, region=region,
        prompt_ids=ints(result.prompt_ids), token_ids=ints(result.token_ids),
        logprobs=TensorData.from_torch(result.logprobs.to("cpu").float()),
        token_versions=ints(result.policy_versions),
        routed_experts=None if routed is None else TensorData.from_torch(routed.to("cpu").short()),
        sampling=sampling(result), params=ServedParams(
            max_tokens=call.engine_requests[i].max_new_tokens, n=req.n, stop=list(api.stops_of(req)),
            seed=req.seed, logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0,
            stream=bool(req.stream), tools=len(req.tools or ()), tool_choice=str(req.tool_choice or "auto")),
        finish_reason=finish, text=result.text, history_edited=bool(call.edits), created_at=clock(),
        latency_s=time.perf_counter() - call.started,
        metadata={k: v for k, v in (req.metadata or {}).items()},
        allowed=None if result.allowed is None else AllowedTokens.pack(np.arange(len(result.token_ids)),
                                                                       result.allowed.numpy()),
    )


def sampled_turn(result: GenerationResult, content: str | None, calls: list[Any], finish: str, *,
                 position: int) -> SampledTurn:
    """A session's record of one turn as sampled at ``position`` (`rlbus.serve.sessions` maps later requests
    onto it)."""
    routed = result.routed_experts
    return SampledTurn(
        key=api.turn_key(content, calls), prompt_ids=tuple(result.prompt_ids), token_ids=tuple(result.token_ids),
        logprobs=tuple(float(x) for x in result.logprobs.tolist()), versions=tuple(result.policy_versions),
        text=result.text, finish_reason=finish,
        routed_experts=None if routed is None else routed.to("cpu").numpy().astype(np.int16),
        position=position, allowed=None if result.allowed is None else result.allowed.numpy(),
    )


def completion_rollout(
    call: Call, i: int, result: GenerationResult, finish: str, *, group_size: int, chat: ChatFormat,
    model_id: str, worker_id: str, region: str, clock: Callable[[], float],
) -> Rollout:
    """Choice ``i`` of a completion recorded as a rollout: the context, the sampled ids and the turn's closing,
    under the id `Call.rollout_ids` gives it (``clock`` stamps ``created_at``)."""
    seq = call.context.copy()
    start = len(seq.ids) - len(chat.model_header)
    seq.add_sampled(list(result.token_ids), [float(x) for x in result.logprobs.tolist()],
                    list(result.policy_versions), None if result.allowed is None else result.allowed.numpy())
    seq.add(chat.turn_closing(result.token_ids))
    turns = [*seq.turns, Turn(role="assistant", text=result.text, start=start, end=len(seq.ids))]
    routed = result.routed_experts
    return Rollout(
        rollout_id=call.rollout_ids()[i], prompt_id=call.prompt_id(), group_index=i, group_size=group_size,
        model_id=model_id, worker_id=worker_id, region=region,
        token_ids=TensorData.from_numpy(np.asarray(seq.ids, dtype=np.int32)),
        loss_mask=TensorData.from_numpy(np.asarray(seq.mask, dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.asarray(seq.logprobs, dtype=np.float32)),
        token_versions=TensorData.from_numpy(np.asarray(seq.versions, dtype=np.int32)),
        routed_experts=None if routed is None else routing_full(routed, len(seq.ids)),
        sampling=sampling(result), turns=turns, finish_reason=finish, created_at=clock(),
        metadata={"origin": "served", "tenant": call.tenant, "session_id": "", "request_ids": call.served_id,
                  **({"task": task} if (task := (call.request.metadata or {}).get("task")) else {})},
        allowed=seq.allowed_tokens(),
    )


def ints(ids: Sequence[int]) -> TensorData:
    return TensorData.from_numpy(np.asarray(ids, dtype=np.int32))


def sampling(result: GenerationResult) -> SamplingInfo:
    """How a result was sampled, and which log-probs it carries (of the sampled distribution, or raw)."""
    spec = result.logprob_spec
    return SamplingInfo(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                        logprob_kind="sampled" if spec.processed else "raw")


def routing_full(routed: Any, total: int) -> TensorData:
    """[L, P + N - 1, k] of one call → [L, T, k] over the rollout (its last position, never fed: -1)."""
    array = routed.to("cpu").numpy().astype(np.int16)
    out = np.full((array.shape[0], total, array.shape[2]), -1, dtype=np.int16)
    out[:, : array.shape[1]] = array
    return TensorData.from_numpy(out)
