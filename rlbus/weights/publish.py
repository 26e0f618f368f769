"""Trainer side of weight sync: cast, encode against the last published version, upload, announce.

Each call to :meth:`WeightPublisher.publish` makes one version ``S_v`` = the master weights cast to the
inference dtype. It encodes the delta ``S_{v-1} → S_v`` (and, every ``keyframe_every`` versions, a full
keyframe of ``S_v``) off the event loop, uploads the chunks, writes the manifests next to them in the
blob store, and only then announces the delta manifest on ``rl.weights.v1`` and ``rl.weights.latest.v1``
— so a worker never sees a manifest whose chunks are not there yet. Every key it writes, and the
manifest's dtype names, come from :mod:`rlbus.weights.layout`.

A trainer on N ranks encodes and uploads each rank's part itself (`rlbus.training.shard_publish`) and
hands this publisher the parts' chunk references (:meth:`WeightPublisher.publish_sharded`): the manifests,
the announcement, the stats and the garbage collection are the same code for both (``_announce``), and
`encode_part` is the one encoding both use.

Versions older than the retention window are deleted, but never the newest keyframe or anything after
it, so a late joiner can always rebuild (keyframe + chain of deltas).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlbus.blobs.base import BlobStore
from rlbus.bus.base import Bus
from rlbus.bus.topics import WEIGHTS, WEIGHTS_LATEST
from rlbus.errors import BlobStoreError
from rlbus.metrics import record_publish
from rlbus.schemas import ChunkRef, TensorMeta, TensorSpan, WeightVersion, encode
from rlbus.weights.codec import CHUNK_BYTES, Chunk, encode_state_delta, encode_state_keyframe
from rlbus.weights.codec.warm import warm_kernels
from rlbus.weights.digest import state_digest
from rlbus.weights.layout import DTYPE_NAMES, chunk_key, manifest_key

log = logging.getLogger("rlbus.weights.publish")


@dataclass(frozen=True)
class PublishStats:
    version: int
    kind: str
    full_bytes: int
    delta_bytes: int
    keyframe_bytes: int
    encode_s: float
    upload_s: float
    announce_s: float

    @property
    def total_s(self) -> float:
        return self.encode_s + self.upload_s + self.announce_s


class WeightPublisher:
    """Publishes successive versions of one model. Keeps the last published snapshot (in the inference
    dtype, on CPU) as the base of the next delta."""

    def __init__(
        self,
        *,
        bus: Bus,
        store: BlobStore,
        model_id: str = "policy",
        dtype: torch.dtype = torch.bfloat16,
        keyframe_every: int = 10,
        retain_versions: int = 20,
        chunk_bytes: int = CHUNK_BYTES,
        store_url: str = "",
        upload_parallelism: int = 8,
        clock: Callable[[], float] = time.time,
        encode_threads: int | None = None,
    ) -> None:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"inference dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
        if keyframe_every < 1 or retain_versions < 1:
            raise ValueError("keyframe_every and retain_versions must be ≥ 1")
        self._bus = bus
        self._store = store
        self.model_id = model_id
        self.dtype = dtype
        self.keyframe_every = keyframe_every
        self.retain_versions = retain_versions
        self.chunk_bytes = chunk_bytes
        self.store_url = store_url
        self._uploads = asyncio.Semaphore(upload_parallelism)
        self._clock = clock
        self._last: dict[str, torch.Tensor] | None = None
        self._spare: dict[str, torch.Tensor] | None = None
        #: Threads encoding a version (records in parallel; the codec's kernels release the GIL).
        self.encode_threads = encode_threads or os.cpu_count() or 1
        self.version = 0
        self.keyframe_version = 0
        self.history: list[PublishStats] = []

    def snapshot(self, master: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inference-dtype CPU copy of the master weights (what workers become bit-identical to).

        Written into the buffers of the version before the last one published when they fit (a fresh
        1.4 GB copy faults in every page, ~1 s here; a copy into the old buffers does not): a snapshot is
        the publisher's once it is handed to `publish_snapshot`, and the one before the last is no
        longer needed by then."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.keys() == master.keys() and all(
            spare[k].shape == t.shape for k, t in master.items()
        ):
            with torch.no_grad():
                for name, t in master.items():
                    spare[name].copy_(t.detach())
            return spare
        return {name: t.detach().to("cpu", self.dtype, copy=True).contiguous() for name, t in master.items()}

    @property
    def store(self) -> BlobStore:
        """Where the chunks and manifests go (a rank of a sharded trainer uploads its chunks there too)."""
        return self._store

    def _check_version(self, version: int) -> None:
        if version <= self.version:
            raise ValueError(f"version {version} is not above v{self.version}, published last: versions never repeat")

    async def publish(self, master: Mapping[str, torch.Tensor], *, version: int, step: int = 0) -> WeightVersion:
        """Publish ``master`` as ``version``; returns its delta manifest (the keyframe manifest for the first).

        The caller owns the version sequence (the trainer: `rlbus.training.trainer.Trainer`); this only
        refuses to go backwards. ``version`` is usually the last published + 1; a jump (a restored trainer
        continuing a run's numbering) is fine — the delta's base is always the version published last.
        """
        self._check_version(version)
        snapshot = await asyncio.to_thread(self.snapshot, master)
        return await self.publish_snapshot(snapshot, version=version, step=step)

    async def publish_snapshot(
        self, snapshot: dict[str, torch.Tensor], *, version: int, step: int = 0
    ) -> WeightVersion:
        """Publish a `snapshot` taken earlier (the trainer takes it right after its step and publishes it
        while the next step trains: `rlbus.training.trainer`). The snapshot is the publisher's from now on."""
        self._check_version(version)
        if self._last is None:  # the first version: compile the codec now, not in the middle of the run
            await asyncio.to_thread(warm_kernels, [self.dtype])
        t0 = time.perf_counter()
        with_keyframe = self._last is None or version % self.keyframe_every == 0
        try:
            part = await asyncio.to_thread(encode_part, self._last, snapshot, keyframe=with_keyframe,
                                           chunk_bytes=self.chunk_bytes, threads=self.encode_threads)
            digest = await asyncio.to_thread(state_digest, snapshot)
            t1 = time.perf_counter()
            refs = {kind: await self._upload(version, kind, chunks) for kind, chunks in part.chunks().items()}
            manifest = await self._announce(version, step, refs, part.tensors, digest, part.full_bytes,
                                            encoded=part.encoded_bytes(), encode_s=t1 - t0, upload_from=t1)
        except BaseException:
            self._spare = snapshot  # not published: its buffers serve the next snapshot
            raise
        self._last, self._spare = snapshot, self._last
        return manifest

    async def publish_sharded(
        self, parts: Sequence[PartRefs], *, digest: str, version: int, step: int = 0, encode_s: float = 0.0,
    ) -> WeightVersion:
        """Publish a version the trainer's ranks encoded and uploaded each for its own tensors
        (`rlbus.training.shard_publish`): upload what a rank could not (it has no blob store of its own),
        then write the one manifest per kind listing every rank's chunks in rank order — the ranks own
        consecutive runs of the sorted tensor names, so that is the one-process order — with ``digest``,
        the whole-model digest rank 0 computed. Raises BlobStoreError when a rank's upload failed: nothing
        is announced and the ranks keep their delta base."""
        self._check_version(version)
        failed = [f"rank {p.rank}: {p.error}" for p in parts if p.error is not None]
        if failed:
            raise BlobStoreError(f"v{version}: " + "; ".join(failed))
        t1 = time.perf_counter()

        async def put(key: str, data: bytes) -> None:
            async with self._uploads:
                await self._store.put(key, data)

        await asyncio.gather(*(put(k, d) for p in parts for k, d in p.unsent.items()))
        refs: dict[str, list[ChunkRef]] = {}
        for kind in ("delta", "keyframe"):
            lists = [p.delta if kind == "delta" else p.keyframe for p in parts]
            if all(refs_ is not None for refs_ in lists):
                refs[kind] = [r for refs_ in lists for r in refs_ or ()]
            elif any(refs_ is not None for refs_ in lists):
                raise ValueError(f"v{version}: some ranks encoded a {kind} and some did not")
        tensors = sorted((t for p in parts for t in p.tensors), key=lambda t: t.name)
        return await self._announce(version, step, refs, tensors, digest, sum(p.full_bytes for p in parts),
                                    encoded={k: sum(r.size for r in v) for k, v in refs.items()},
                                    encode_s=encode_s, upload_from=t1)

    async def _announce(
        self, version: int, step: int, refs: Mapping[str, list[ChunkRef]], tensors: list[TensorMeta], digest: str,
        full_bytes: int, *, encoded: Mapping[str, int], encode_s: float, upload_from: float,
    ) -> WeightVersion:
        """Write the manifests of chunks already uploaded, announce them, record the stats, collect garbage."""
        manifests: list[WeightVersion] = []
        with_keyframe = "keyframe" in refs
        keyframe_version = version if with_keyframe else self.keyframe_version
        for kind in ("delta", "keyframe"):
            if kind not in refs:
                continue
            manifest = WeightVersion(
                model_id=self.model_id,
                version=version,
                base_version=self.version if kind == "delta" else None,
                kind=kind,
                keyframe_version=keyframe_version,
                dtype=DTYPE_NAMES[self.dtype],
                chunks=list(refs[kind]),
                tensors=tensors,
                model_digest=digest,
                full_bytes=full_bytes,
                encoded_bytes=encoded.get(kind, 0),
                blob_store=self.store_url,
                trainer_step=step,
                created_at=self._clock(),
            )
            await self._store.put(manifest_key(self.model_id, version, kind), encode(manifest))
            manifests.append(manifest)
        t2 = time.perf_counter()

        for manifest in manifests:
            await self._bus.send(WEIGHTS, manifest)
        await self._bus.send(WEIGHTS_LATEST, manifests[0])
        t3 = time.perf_counter()

        self.version = version
        self.keyframe_version = keyframe_version
        stats = PublishStats(
            version=version,
            kind="+".join(m.kind for m in manifests),
            full_bytes=full_bytes,
            delta_bytes=encoded.get("delta", 0),
            keyframe_bytes=encoded.get("keyframe", 0),
            encode_s=encode_s,
            upload_s=t2 - upload_from,
            announce_s=t3 - t2,
        )
        self.history.append(stats)
        record_publish(stats)
        log.info(
            "published %s v%d (%s): delta %d B, keyframe %d B of %d B full; encode %.3fs upload %.3fs",
            self.model_id, version, stats.kind, stats.delta_bytes, stats.keyframe_bytes, full_bytes,
            stats.encode_s, stats.upload_s, extra={"version": version},
        )
        try:
            await self.collect_garbage()
        except BlobStoreError as exc:  # the version is announced; old ones go at the next publish
            log.warning("garbage collection after v%d failed: %s", version, exc)
        return manifests[0]

    async def _upload(self, version: int, kind: str, chunks: list[Chunk]) -> list[ChunkRef]:
        refs = chunk_refs(self.model_id, version, kind, chunks)
        await put_chunks(self._store, refs, chunks, self._uploads)
        return refs

    async def collect_garbage(self) -> list[int]:
        """Delete versions older than the retention window, keeping the newest keyframe and after."""
        cutoff = min(self.version - self.retain_versions + 1, self.keyframe_version)
        doomed: dict[int, list[str]] = {}
        for key in await self._store.list(f"{self.model_id}/"):
            part = key[len(self.model_id) + 1 :].split("/", 1)[0]
            if part.isdigit() and int(part) < cutoff:
                doomed.setdefault(int(part), []).append(key)
        for keys in doomed.values():
            await asyncio.gather(*(self._store.delete(k) for k in keys))
        return sorted(doomed)


@dataclass(frozen=True)
class EncodedPart:
    """One owner's encoding of its tensors for one version (the whole model for a one-process trainer,
    one rank's run of tensors on N ranks): the delta and keyframe chunks, when made, and the tensors'
    metadata (with their own digests)."""

    delta: list[Chunk] | None
    keyframe: list[Chunk] | None
    tensors: list[TensorMeta]
    full_bytes: int

    def chunks(self) -> dict[str, list[Chunk]]:
        """The chunks by kind, the delta first (the manifest order)."""
        return {k: c for k, c in (("delta", self.delta), ("keyframe", self.keyframe)) if c is not None}

    def encoded_bytes(self) -> dict[str, int]:
        return {kind: sum(c.size for c in chunks) for kind, chunks in self.chunks().items()}


@dataclass(frozen=True)
class PartRefs:
    """What rank 0 learns of one rank's part of a sharded version: its chunks' references (global chunk
    indices, uploaded or not), its tensors' metadata, and the bytes of the chunks it had no blob store to
    upload (key → data; rank 0 puts them)."""

    rank: int
    delta: list[ChunkRef] | None
    keyframe: list[ChunkRef] | None
    tensors: list[TensorMeta]
    full_bytes: int
    unsent: dict[str, bytes]
    error: str | None = None


def encode_part(
    last: Mapping[str, torch.Tensor] | None, snapshot: Mapping[str, torch.Tensor], *, keyframe: bool,
    chunk_bytes: int = CHUNK_BYTES, threads: int = 1,
) -> EncodedPart:
    """Encode ``snapshot``: the delta from ``last`` when there is one, a keyframe when asked (or when
    there is no ``last``). The codec cuts a state into self-contained chunks in sorted-name order, so
    parts of disjoint tensors encoded apart apply like one state's chunks."""
    delta = encode_state_delta(last, snapshot, chunk_bytes, threads=threads) if last is not None else None
    frame = encode_state_keyframe(snapshot, chunk_bytes, threads=threads) if keyframe or last is None else None
    full = sum(t.numel() * t.element_size() for t in snapshot.values())
    return EncodedPart(delta, frame, _tensor_metas(snapshot), full)


def chunk_refs(model_id: str, version: int, kind: str, chunks: Sequence[Chunk], first: int = 0) -> list[ChunkRef]:
    """The manifest's references to ``chunks``, numbered from ``first`` (a rank's offset among all ranks)."""
    return [
        ChunkRef(
            key=chunk_key(model_id, version, kind, first + i),
            size=c.size,
            hash=c.hash,
            tensors=[TensorSpan(name=r.name, start=r.start, stop=r.stop) for r in c.tensors],
        )
        for i, c in enumerate(chunks)
    ]


async def put_chunks(
    store: BlobStore, refs: Sequence[ChunkRef], chunks: Sequence[Chunk], limit: asyncio.Semaphore,
) -> None:
    """Upload ``chunks`` under their references' keys, at most ``limit`` at a time."""

    async def put(ref: ChunkRef, chunk: Chunk) -> None:
        async with limit:
            await store.put(ref.key, chunk.data)

    await asyncio.gather(*(put(ref, c) for ref, c in zip(refs, chunks, strict=True)))


def _tensor_metas(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    return [
        TensorMeta(
            name=name,
            dtype=DTYPE_NAMES[t.dtype],
            shape=list(t.shape),
            digest=state_digest({name: t}),
        )
        for name, t in sorted(state.items())
    ]
