"""``Served`` — one completion the gateway served to a user or an agent harness, token-exact.

Produced by ``rlbus.serve.recorder`` on ``rl.served.v1`` (key ``session_id`` when the completion belongs to
an agent session, else ``served_id``: a session's turns share a partition and stay in order); consumed by
whatever learns from production traffic (the online trainer side joins it with user rewards by id, offline
jobs mine it) and by ``rlbus tail``. One record per choice: a request with ``n`` = 3 writes three records
sharing ``served_id`` with ``choice_index`` 0..2.

Exactness: ``prompt_ids`` are the ids the engine was fed (the chat template's rendering, with earlier
assistant turns of a session mapped to the ids actually sampled, see ``rlbus.serve.sessions``), and
``token_ids`` the ids it sampled — the stop token included — never a re-tokenisation of the text the user
saw. ``logprobs`` are log π' of the distribution each token was drawn from (``sampling`` says how), and
``token_versions`` the policy version that computed each token's distribution.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from rlbus.schemas.base import Message
from rlbus.schemas.rollout import AllowedTokens, SamplingInfo
from rlbus.schemas.tensor import TensorData


class ServedParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """The request's sampling parameters, as the client sent them (after defaults)."""

    max_tokens: int
    n: int = 1
    stop: list[str] = msgspec.field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    tools: int = 0
    """How many tool schemas the request carried."""
    tool_choice: str = "auto"


class Served(Message, kw_only=True):
    SCHEMA_VERSION: ClassVar[int] = 1

    schema_version: int = 1
    #: The response ``id`` (``chatcmpl-…``): the handle user feedback names.
    served_id: str
    choice_index: int = 0
    #: The gateway's request id (``X-Request-Id`` if the client sent one, else the served id).
    request_id: str
    tenant: str
    #: The agent session (``X-RL-Session`` / ``user``), "" for a single completion.
    session_id: str = ""
    #: The client's ``user`` field, if any.
    user: str = ""
    model_id: str = "policy"
    #: The name the client asked for (``model`` of the request).
    model_name: str = ""
    worker_id: str = ""
    region: str = ""
    #: int32 [P] the prompt as the engine was fed it.
    prompt_ids: TensorData
    #: int32 [N] the sampled ids, stop token included.
    token_ids: TensorData
    #: float32 [N] log π'(token) under the distribution sampled from.
    logprobs: TensorData
    #: int32 [N] the policy version that produced each token.
    token_versions: TensorData
    #: int16 [layers, P + N - 1, k] experts each input token was routed to (MoE policies), else None.
    routed_experts: TensorData | None = None
    sampling: SamplingInfo = msgspec.field(default_factory=SamplingInfo)
    params: ServedParams
    #: ``stop``, ``length`` or ``tool_calls``.
    finish_reason: str
    #: The text returned to the client (before tool-call parsing).
    text: str = ""
    #: True when the client edited earlier turns of its session (see ``rlbus.serve.sessions``).
    history_edited: bool = False
    created_at: float = 0.0
    #: Seconds from the request's arrival to its last token.
    latency_s: float = 0.0
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    #: The masks the sampled ids were drawn under when the request was constrained (``tool_choice``
    #: required or named, ``response_format`` json), positions into ``token_ids``; None: unconstrained.
    allowed: AllowedTokens | None = None
