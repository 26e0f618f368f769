"""Sharded publishing: on N ranks each rank casts, delta-encodes and uploads its own part of the weights.

A trainer on N ranks (`rlbus.training.ranks`) publishes a version without rank 0 ever holding the model:

1. **Owners.** The weights' names, in sorted order, are cut into N consecutive runs balanced by bytes
   (`assign_owners`, the same on every rank: it depends only on names and shapes), to within the largest
   tensor (a vocabulary embedding is one owner's). Rank r *owns* run r.
2. **Gather to the owner.** For each tensor every rank casts its FSDP dim-0 shard to the inference dtype
   and sends it to the tensor's owner alone (`dist.gather`), so the inference-dtype model crosses the
   network once in all — half the fp32 gather's bytes for bf16 — and an owner holds only its own run.
3. **Encode and upload.** Each rank encodes its run with the one-process codec (`encode_part`: the delta
   against its own previous snapshot of the run, a keyframe every ``keyframe_every`` versions) and uploads
   its chunks from its own process, all ranks at once (every rank's egress). A rank with no blob store of
   its own (the launch default: followers stay off the store, `rlbus.launch.roles.follow_leader`) hands its
   encoded chunks to rank 0, which uploads them: encoding is parallel either way.
4. **The manifest.** Rank 0 collects each rank's chunk references (small objects over gloo) and writes one
   manifest per kind with every rank's chunks in rank order (`WeightPublisher.publish_sharded`). Chunks are
   numbered globally (the ranks exchange their counts first), so the blob layout is the one-process one.

Why whole tensors and not each rank's dim-0 slice as it sits in FSDP: the codec plans records, chunk
tables and the per-tensor digests over whole tensors by name; encoding a slice would need every record to
know a shape it does not hold. Owning whole tensors reuses the codec unchanged and keeps every chunk
self-contained, so a worker applies a sharded version exactly as a one-process one (`rlbus.weights.sync`
needs no change: chunks of disjoint tensors can be applied in any order, and a keyframe's chunk tables give
the shapes whoever encoded them).

The whole-model digest is unchanged (workers verify as today), but xxh3-128 is one stream over the
tensors in sorted-name order whose state cannot be pickled, so it cannot be combined from per-rank parts:
rank 0 runs the hasher and each owner streams its tensors to it, one tensor at a time
(`rlbus.weights.digest.digest_update`). Rank 0 therefore still receives the inference-dtype bytes once,
but never holds more than one tensor of another rank and encodes none of them. Per-tensor digests in the
manifest are computed by the owners.

The delta base is per rank: each keeps the snapshot of its run it last encoded, *pending* until the
leader's next publish names that version as the base (the leader only advances its version once the
manifest is announced, so a failed publish leaves every rank on the old base). Like the one-process
publisher's, the base lives in memory only: a restarted trainer has none, so its first version is a
keyframe on every rank; a delta is made only when every rank holds the base (an all-gather of one flag).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from rlbus.blobs.base import BlobStore
from rlbus.errors import BlobStoreError
from rlbus.training.ranks import Ranks
from rlbus.weights.codec import CHUNK_BYTES
from rlbus.weights.codec.warm import warm_kernels
from rlbus.weights.digest import digest_update
from rlbus.weights.publish import PartRefs, chunk_refs, encode_part, put_chunks


@dataclass(frozen=True)
class ShardOrder:
    """What the leader broadcasts for one sharded version: the publisher's settings and the version."""

    model_id: str
    version: int
    #: The version the leader published last: the delta's base.
    base_version: int
    keyframe_every: int
    dtype: torch.dtype
    chunk_bytes: int = CHUNK_BYTES


def assign_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Each tensor's owning rank: consecutive runs of the sorted names, balanced by bytes (a tensor goes to
    the rank whose share of the total its middle byte falls in). Deterministic: every rank computes it."""
    total = sum(sizes.values())
    owners: dict[str, int] = {}
    done = 0
    for name in sorted(sizes):
        middle = done + sizes[name] / 2
        owners[name] = min(world - 1, int(middle * world / total)) if total else 0
        done += sizes[name]
    return owners


class ShardPublisher:
    """One rank's side of sharded publishing (every rank of an N-rank trainer holds one)."""

    def __init__(self, *, store: BlobStore | None = None, loop: asyncio.AbstractEventLoop | None = None,
                 upload_parallelism: int = 8) -> None:
        """``store``: this rank uploads its chunks there itself, on ``loop`` (the event loop the store
        belongs to; `publish` runs in a worker thread). Without a store the chunks go to rank 0."""
        self.store = store
        self.loop = loop
        self.upload_parallelism = upload_parallelism
        self._base: tuple[int, dict[str, torch.Tensor]] | None = None
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        #: What this rank encoded and uploaded itself, over its life (chunks, bytes).
        self.uploaded_chunks = 0
        self.uploaded_bytes = 0

    def publish(self, model: Any, ranks: Ranks, order: ShardOrder) -> tuple[list[PartRefs], str] | None:
        """Encode and upload this rank's part of ``order.version``. Collective (every rank, in a worker
        thread); returns every rank's part and the whole-model digest on rank 0, None on the others."""
        if self._pending is not None and self._pending[0] == order.base_version:
            self._base = self._pending  # the leader announced it: the base of this delta
        self._pending = None
        if self._base is None:  # the first version: compile the codec now, not in the middle of the run
            warm_kernels([order.dtype])
        have = self._base is not None and self._base[0] == order.base_version
        delta = all(ranks.gather(have))
        keyframe = not delta or order.version % order.keyframe_every == 0

        params = dict(model.named_parameters())
        size = torch.empty((), dtype=order.dtype).element_size()
        owners = assign_owners({n: p.numel() * size for n, p in params.items()}, ranks.world)
        mine = owned_weights(params, owners, ranks, order.dtype)
        part = encode_part(self._base[1] if delta and self._base is not None else None, mine, keyframe=keyframe,
                           chunk_bytes=order.chunk_bytes)

        counts = ranks.gather({kind: len(chunks) for kind, chunks in part.chunks().items()})
        refs = {kind: chunk_refs(order.model_id, order.version, kind, chunks,
                                 first=sum(c.get(kind, 0) for c in counts[: ranks.rank]))
                for kind, chunks in part.chunks().items()}
        pairs = [pair for kind, chunks in part.chunks().items() for pair in zip(refs[kind], chunks, strict=True)]
        unsent: dict[str, bytes] = {}
        error = None
        if self.store is None:
            unsent = {r.key: c.data for r, c in pairs}
        else:
            try:
                self._upload(pairs)
            except BlobStoreError as exc:  # reported to rank 0, which refuses the version (train on)
                error = f"{type(exc).__name__}: {exc}"
        digest = stream_digest(mine, owners, ranks, {n: tuple(p.shape) for n, p in params.items()}, order.dtype)
        self._pending = (order.version, mine)
        parts = ranks.collect(PartRefs(rank=ranks.rank, delta=refs.get("delta"), keyframe=refs.get("keyframe"),
                                       tensors=part.tensors, full_bytes=part.full_bytes, unsent=unsent, error=error))
        if parts is None:
            return None
        assert digest is not None
        return parts, digest

    def _upload(self, pairs: list[Any]) -> None:
        """Upload (ref, chunk) pairs on the store's event loop, from this worker thread."""
        assert self.store is not None
        if self.loop is None:
            raise ValueError("a ShardPublisher with a store needs the event loop the store runs on")
        refs, chunks = [r for r, _ in pairs], [c for _, c in pairs]

        async def put_all() -> None:
            await put_chunks(self.store, refs, chunks, asyncio.Semaphore(self.upload_parallelism))  # type: ignore[arg-type]

        asyncio.run_coroutine_threadsafe(put_all(), self.loop).result()
        self.uploaded_chunks += len(chunks)
        self.uploaded_bytes += sum(c.size for c in chunks)


def owned_weights(params: Mapping[str, Any], owners: Mapping[str, int], ranks: Ranks,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full tensors this rank owns, cast to ``dtype``, on CPU. Collective: for each parameter (in the
    same order on every rank) each rank sends its dim-0 FSDP shard, already cast, to the owner only.
    Casting is element-wise, so the owner's tensor is bit for bit the cast of the full fp32 tensor."""
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        owner = owners[name]
        shape = tuple(p.shape)
        if not isinstance(p, DTensor):  # not sharded: every rank holds all of it
            if ranks.rank == owner:
                out[name] = p.detach().to("cpu", dtype, copy=True).contiguous()
            continue
        if p.dim() == 0 or tuple(p.placements) != (Shard(0),):
            full = p.full_tensor()  # collective
            if ranks.rank == owner:
                out[name] = full.detach().to("cpu", dtype, copy=True).contiguous()
            continue
        row = (p.numel() // shape[0] if shape[0] else 0) * torch.empty((), dtype=dtype).element_size()
        per = -(-shape[0] // ranks.world) * row  # the padded bytes of one rank's rows
        if per == 0:
            if ranks.rank == owner:
                out[name] = torch.empty(shape, dtype=dtype)
            continue
        local = p.to_local().detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8)
        lo, hi = ranks.rows(0, shape[0])
        if local.numel() != (hi - lo) * row:
            raise RuntimeError(f"{name}: rank {ranks.rank} holds {local.numel()} B, expected rows [{lo}, {hi})")
        padded = torch.zeros(per, dtype=torch.uint8)
        padded[: local.numel()] = local
        buffers = [torch.empty(per, dtype=torch.uint8) for _ in range(ranks.world)] if ranks.rank == owner else None
        dist.gather(padded, buffers, dst=owner)
        if buffers is not None:
            pieces = []
            for r, buffer in enumerate(buffers):
                a, b = ranks.rows(0, shape[0], r)
                pieces.append(buffer[: (b - a) * row])
            out[name] = torch.cat(pieces).view(dtype).reshape(shape)
    return out


def stream_digest(mine: Mapping[str, torch.Tensor], owners: Mapping[str, int], ranks: Ranks,
                  shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> str | None:
    """The whole-model digest (`rlbus.weights.digest.state_digest` of all ranks' tensors together), on
    rank 0 (None elsewhere). Collective: the owners send rank 0 their tensors in sorted-name order, one at
    a time, because the hash is one stream that cannot be split (see the module's docstring)."""
    h = xxhash.xxh3_128() if ranks.leader else None
    for name in sorted(owners):
        owner = owners[name]
        if owner == 0:
            if h is not None:
                digest_update(h, name, mine[name])
            continue
        numel = 1
        for s in shapes[name]:
            numel *= s
        if ranks.rank == owner and numel:
            dist.send(mine[name].reshape(-1).view(torch.uint8), dst=0)
        elif h is not None:
            t = torch.empty(shapes[name], dtype=dtype)
            if numel:
                dist.recv(t.reshape(-1).view(torch.uint8), src=owner)
            digest_update(h, name, t)
    return h.hexdigest() if h is not None else None
