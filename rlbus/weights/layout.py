"""Where a weight version lives in the blob store, and how its manifest names the inference dtype.

The trainer writes this layout (:mod:`rlbus.weights.publish`) and workers read it
(:mod:`rlbus.weights.sync`); both take every key from here, so the layout has one owner.

Blob layout (immutable; a version's directory is complete before it is announced)::

    <model>/<version:010d>/delta-<i:05d>      delta chunks S_{v-1} → S_v
    <model>/<version:010d>/keyframe-<i:05d>   keyframe chunks of S_v (every K versions, and the first)
    <model>/<version:010d>/manifest.delta     the WeightVersion manifests as MessagePack, so a worker
    <model>/<version:010d>/manifest.keyframe  catching up reads any version's manifest without Kafka
"""

from __future__ import annotations

import torch

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def version_prefix(model_id: str, version: int) -> str:
    return f"{model_id}/{version:010d}"


def chunk_key(model_id: str, version: int, kind: str, index: int) -> str:
    return f"{version_prefix(model_id, version)}/{kind}-{index:05d}"


def manifest_key(model_id: str, version: int, kind: str) -> str:
    return f"{version_prefix(model_id, version)}/manifest.{kind}"
