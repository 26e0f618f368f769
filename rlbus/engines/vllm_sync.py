"""Weight sync into vLLM: stage against the worker's own copy, hand vLLM only what changed, prove the digest.

A vLLM rollout worker keeps its own bf16 copy of the weights in trainer (checkpoint) names — the *mirror*
(`rlbus.models.sources.ModelSource.build`). `VLLMWeightSync` is the ordinary `WeightSync` over that mirror
(download, verify, decode against it while vLLM generates; double-buffered, so the swap only re-points
the mirror's parameters) plus one step inside the swap: `push_staged` hands vLLM the tensors the version
changed, fused groups whole, through `VLLMEngine.push` (a whole-tensor reload on CPU, an in-place scatter of
the changed elements on GPU), and resets vLLM's prefix cache. The swap runs at the engine's `SwapPoint`,
between two engine steps, so a request in flight continues on the new version and its tokens say so.

After every version the digest of what vLLM was handed (`VLLMEngine.received_digest`) must equal the
manifest's — the trainer's — digest, as the mirror's must; a mismatch refuses the version like any other
(`DigestMismatch`: the worker rebuilds from a keyframe, which pushes every tensor).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlbus.errors import DigestMismatch
from rlbus.schemas import WeightVersion
from rlbus.weights.codec import StagedUpdate
from rlbus.weights.sync import WeightSync

if TYPE_CHECKING:
    from rlbus.engines.vllm_engine import PushStats, VLLMEngine


class VLLMWeightSync(WeightSync):
    """`WeightSync` whose swap also pushes the changed tensors into a `VLLMEngine` (module docstring)."""

    def __init__(self, *, engine: VLLMEngine, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        self.staged: list[StagedUpdate] = []
        self.vllm_verified = 0

    async def stage(
        self, manifest: WeightVersion, fetched: Mapping[str, Awaitable[bytes]] | None = None
    ) -> tuple[list[StagedUpdate], int]:
        staged, fetched_bytes = await super().stage(manifest, fetched)
        self.staged = staged  # what the swap of this version hands vLLM
        return staged, fetched_bytes

    async def _apply(
        self, manifest: WeightVersion, *, rebuilt: bool, fetched: Mapping[str, Awaitable[bytes]] | None = None
    ) -> None:
        await super()._apply(manifest, rebuilt=rebuilt, fetched=fetched)
        received = await asyncio.to_thread(self.engine.received_digest)
        if received != manifest.model_digest:
            self.version = None
            self.digest = None
            raise DigestMismatch(
                f"{self.model_id} v{manifest.version}: vLLM was handed weights of digest {received}, the manifest "
                f"says {manifest.model_digest}"
            )
        self.vllm_verified += 1


def push_staged(
    engine: VLLMEngine, state: Mapping[str, torch.Tensor], staged: list[StagedUpdate], version: int
) -> PushStats:
    """Hand ``engine`` the tensors ``staged`` changed, from ``state`` (the mirror, already swapped), with
    their fused partners; the changed elements too, for the scatter path. Call it inside the swap."""
    from rlbus.engines.vllm_worker import with_fused

    names = with_fused({u.name for u in staged}, set(state))
    tensors = {name: state[name] for name in names}
    changes = changed_elements(staged) if engine.push_mode == "scatter" else None
    return engine.push(tensors, version=version, changes=changes)


def changed_elements(staged: list[StagedUpdate]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name → (flat int64 positions, new values) over every staged update of that tensor (dense runs
    become their positions), in application order, so scattering them reproduces the swap."""
    parts: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for u in staged:
        pos, val = parts.setdefault(u.name, ([], []))
        upd = u.update
        if upd.dense is not None:
            pos.append(torch.arange(upd.dense_start, upd.dense_start + len(upd.dense), dtype=torch.int64))
            val.append(upd.dense)
        if len(upd.positions):
            pos.append(upd.positions.to(torch.int64))
            val.append(upd.values)
    return {name: (torch.cat(p), torch.cat(v)) for name, (p, v) in parts.items() if p}
