"""``Rollout`` — one agent episode: tokens, behaviour log-probs, loss mask, MoE routing, transcript.

Produced by ``consumers/rollout.py`` on ``rl.rollouts.v1`` (key ``prompt_id``, so a group shares a
partition); consumed by the reward workers and the trainer. Token-aligned arrays all have length T, the
full sequence (prompt, model turns and environment observations); ``loss_mask`` says which tokens the
model produced and are trained.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import numpy as np
import zstandard

from rlbus.schemas.base import Message
from rlbus.schemas.common import BlobRef
from rlbus.schemas.prompt import Prompt
from rlbus.schemas.tensor import TensorData


class SamplingInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """How the behaviour log-probs were computed: log π of the distribution actually sampled from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    #: ``"sampled"``: log-prob after temperature and truncation, renormalised; ``"raw"``: of the
    #: untempered, untruncated model distribution.
    logprob_kind: str = "sampled"


class AllowedTokens(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """The allowed-token masks of tokens sampled under a grammar (constrained decoding,
    `rlbus.engines.constraints`): the behaviour log-probs are of the masked, renormalised distribution,
    and the trainer masks its logits the same way at these positions so the importance ratio stays exact.

    ``masks`` is zstd-compressed int32 [M, words], little-endian, llguidance's layout (bit ``i % 32`` of
    word ``i // 32`` allows token ``i``): a constrained turn's masks are mostly long runs, a few hundred
    bytes per token compressed where raw they are ``vocab / 8`` bytes."""

    #: int32 [M]: the positions in the token arrays whose token was sampled under a mask, ascending.
    positions: TensorData
    #: int32 words per mask: ceil(vocabulary / 32).
    words: int
    masks: bytes

    @classmethod
    def pack(cls, positions: np.ndarray[Any, Any], bits: np.ndarray[Any, Any]) -> AllowedTokens:
        """From positions [M] and masks [M, words] int32."""
        if bits.ndim != 2 or bits.shape[0] != positions.shape[0]:
            raise ValueError(f"masks {bits.shape} do not match positions {positions.shape}")
        raw = np.ascontiguousarray(bits, dtype="<i4").tobytes()
        return cls(positions=TensorData.from_numpy(np.asarray(positions, dtype=np.int32)), words=int(bits.shape[1]),
                   masks=zstandard.ZstdCompressor(level=3).compress(raw))

    def unpack(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(positions [M] int64, masks [M, words] int32)."""
        positions = self.positions.to_numpy().astype(np.int64)
        raw = zstandard.ZstdDecompressor().decompress(self.masks, max_output_size=4 * self.words * len(positions))
        bits = np.frombuffer(raw, dtype="<i4").reshape(len(positions), self.words).astype(np.int32)
        return positions, bits


class Turn(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One turn of the transcript and the token span [start, end) it occupies."""

    role: str
    text: str
    start: int
    end: int
    #: Context segment (self-summarization starts a new segment with a fresh context).
    segment: int = 0


class Rollout(Message, kw_only=True):
    SCHEMA_VERSION: ClassVar[int] = 1

    schema_version: int = 1
    rollout_id: str
    prompt_id: str
    #: Index of this rollout within its group, 0 ≤ group_index < group_size.
    group_index: int
    group_size: int
    model_id: str = "policy"
    worker_id: str = ""
    region: str = ""
    #: int32 [T] token ids of the whole sequence.
    token_ids: TensorData
    #: uint8 [T]: 1 for model-sampled tokens (trained), 0 for prompt and environment tokens (masked).
    loss_mask: TensorData
    #: float32 [T]: behaviour log-prob of each sampled token, 0 where loss_mask is 0.
    logprobs: TensorData
    #: int32 [T]: policy version that produced each token, -1 for tokens the model did not sample.
    token_versions: TensorData
    #: int16 [layers, T, k] experts each token was routed to, for MoE policies (router replay).
    routed_experts: TensorData | None = None
    sampling: SamplingInfo = msgspec.field(default_factory=SamplingInfo)
    turns: list[Turn] = msgspec.field(default_factory=list)
    #: ``"stop"``, ``"length"``, ``"max_turns"``, ``"error"`` …
    finish_reason: str = "stop"
    #: Seconds spent per phase (``generate``, ``env``, ``swap_wait`` …).
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    created_at: float = 0.0
    #: When the arrays exceed the inline limit they live in the blob store and this points at them.
    payload: BlobRef | None = None
    #: The prompt the episode answered (environment, config, reference), so a reward worker can score
    #: the rollout on its own without joining the prompts topic.
    prompt: Prompt | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    #: The masks of the tokens sampled under a grammar (constrained decoding); None: none were.
    allowed: AllowedTokens | None = None
