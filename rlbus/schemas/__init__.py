"""The contracts: one typed MessagePack struct per message kind (see each module for producer/consumer)."""

from rlbus.schemas.base import Codec, Message, decode, encode
from rlbus.schemas.common import BlobRef
from rlbus.schemas.prompt import Prompt
from rlbus.schemas.reward import Reward
from rlbus.schemas.rollout import AllowedTokens, Rollout, SamplingInfo, Turn
from rlbus.schemas.served import Served, ServedParams
from rlbus.schemas.tensor import TensorData
from rlbus.schemas.weights import ChunkRef, TensorMeta, TensorSpan, WeightVersion

__all__ = [
    "AllowedTokens",
    "BlobRef",
    "ChunkRef",
    "Codec",
    "Message",
    "Prompt",
    "Reward",
    "Rollout",
    "SamplingInfo",
    "Served",
    "ServedParams",
    "TensorData",
    "TensorMeta",
    "TensorSpan",
    "Turn",
    "WeightVersion",
    "decode",
    "encode",
]
