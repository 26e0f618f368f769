"""Schemas: round trips, validation into typed errors, and plain-MessagePack readability."""

from __future__ import annotations

import math

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlbus.errors import MalformedMessage, SchemaError, SchemaVersionError
from rlbus.schemas import (
    BlobRef,
    ChunkRef,
    Codec,
    Prompt,
    Reward,
    Rollout,
    SamplingInfo,
    TensorData,
    TensorMeta,
    TensorSpan,
    Turn,
    WeightVersion,
    encode,
)
from rlbus.schemas.reward import HACK_KINDS, TAMPERED


def sample_rollout() -> Rollout:
    t = 6
    return Rollout(
        rollout_id="r-1",
        prompt_id="p-1",
        group_index=2,
        group_size=8,
        worker_id="w-eu-1",
        region="eu",
        token_ids=TensorData.from_numpy(np.arange(t, dtype=np.int32)),
        loss_mask=TensorData.from_numpy(np.array([0, 0, 1, 1, 0, 1], dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.array([0, 0, -0.1, -2.5, 0, -0.01], dtype=np.float32)),
        token_versions=TensorData.from_numpy(np.array([-1, -1, 3, 3, -1, 4], dtype=np.int32)),
        routed_experts=TensorData.from_numpy(np.zeros((2, t, 2), dtype=np.int16)),
        sampling=SamplingInfo(temperature=0.7, top_p=0.9),
        turns=[Turn(role="user", text="2+2?", start=0, end=2), Turn(role="assistant", text="4", start=2, end=6)],
        timings={"generate": 0.25},
        payload=BlobRef(key="k", size=10, hash="ab", codec="msgpack+zstd"),
    )


def sample_manifest() -> WeightVersion:
    return WeightVersion(
        model_id="policy",
        version=7,
        base_version=6,
        kind="delta",
        keyframe_version=5,
        dtype="bfloat16",
        chunks=[ChunkRef(key="policy/7/0", size=100, hash="00" * 16, tensors=[TensorSpan(name="w", start=0, stop=9)])],
        tensors=[TensorMeta(name="w", dtype="bfloat16", shape=[3, 3], digest="11" * 16)],
        model_digest="22" * 16,
        full_bytes=18,
        encoded_bytes=100,
    )


MESSAGES = [
    Prompt(prompt_id="p-1", env="arith", text="2+2?", env_config={"max_turns": 3}, reference="4"),
    sample_rollout(),
    Reward(reward_id="w-1", rollout_id="r-1", prompt_id="p-1", source="verifier", value=1.0, components={"exact": 1}),
    sample_manifest(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: msgspec.Struct) -> None:
    codec = Codec(type(message))  # type: ignore[arg-type]
    assert codec.decode(codec.encode(message)) == message  # type: ignore[arg-type]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_plain_msgpack_reads_every_message(message: msgspec.Struct) -> None:
    plain = msgpack.unpackb(encode(message), raw=False)  # type: ignore[arg-type]
    assert isinstance(plain, dict) and plain["schema_version"] == 1
    for field in message.__struct_fields__:
        assert field in plain
    if isinstance(message, Rollout):
        tensor = plain["logprobs"]
        values = np.frombuffer(tensor["data"], dtype="<f4").reshape(tensor["shape"])
        assert tensor["dtype"] == "float32" and math.isclose(values[3], -2.5)


def test_wrong_schema_version_is_typed_error() -> None:
    data = msgpack.packb({"schema_version": 2, "prompt_id": "p", "env": "arith", "text": "x"})
    with pytest.raises(SchemaVersionError, match="schema_version 2"):
        Codec(Prompt).decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"schema_version": 1, "prompt_id": "p"}),  # missing fields
        msgpack.packb({"schema_version": 1, "prompt_id": 5, "env": "a", "text": "x"}),  # wrong type
        msgpack.packb({"prompt_id": "p", "env": "a", "text": "x"}),  # no version
    ],
)
def test_malformed_is_typed_error(data: bytes) -> None:
    with pytest.raises(MalformedMessage):
        Codec(Prompt).decode(data)


def test_tensor_size_mismatch_is_malformed() -> None:
    rollout = msgpack.unpackb(encode(sample_rollout()))
    rollout["logprobs"]["shape"] = [7]
    with pytest.raises(MalformedMessage, match="do not match"):
        Codec(Rollout).decode(msgpack.packb(rollout))


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    plain = msgpack.unpackb(encode(MESSAGES[0]))
    plain["added_in_a_later_minor"] = {"x": 1}
    assert Codec(Prompt).decode(msgpack.packb(plain)) == MESSAGES[0]


def test_all_schema_errors_share_one_base() -> None:
    assert issubclass(MalformedMessage, SchemaError) and issubclass(SchemaVersionError, SchemaError)


@given(
    st.sampled_from(["float32", "float16", "bfloat16", "int32", "int64", "uint8"]),
    st.lists(st.integers(0, 4), min_size=0, max_size=3),
    st.integers(0, 2**31),
)
def test_tensor_torch_round_trip_is_bit_exact(dtype: str, shape: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32)
    if dtype in ("float16", "bfloat16"):
        t = bits.to(torch.int16).view(getattr(torch, dtype))
    elif dtype == "float32":
        t = (bits * 65537).view(torch.float32)
    else:
        t = bits.to(getattr(torch, dtype))
    back = TensorData.from_torch(t).to_torch()
    assert back.dtype == t.dtype and list(back.shape) == list(t.shape)
    if t.numel():
        assert torch.equal(back.flatten().view(torch.uint8), t.flatten().view(torch.uint8))


def test_a_reward_reports_the_hacking_its_metadata_names() -> None:
    def kinds(**metadata: str) -> tuple[str, ...]:
        reward = Reward(reward_id="r:v", rollout_id="r", prompt_id="p", source="v", value=1.0, metadata=metadata)
        return reward.hack_kinds

    assert kinds() == kinds(**{HACK_KINDS: ""}) == kinds(**{TAMPERED: ""}) == ()
    assert kinds(**{HACK_KINDS: "always_equal,exit,always_equal"}) == ("always_equal", "exit")
    assert kinds(**{HACK_KINDS: "exit", TAMPERED: "foreign pytest plugin"}) == ("exit", "tampered")
