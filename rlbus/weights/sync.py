"""Worker side of weight sync: follow manifests, stage while generating, swap in place, prove the digest.

For each manifest on ``rl.weights.v1`` the worker *stages* the version — downloads its chunks in
parallel, checks each chunk's xxh3-128 against the manifest, and decodes them (off the event loop) into
positions + values against the weights it holds — while generation continues. The *swap* is then one
in-place scatter per tensor, run through ``swap`` (e.g. the engine's ``SwapPoint.apply``) so it lands
between two decode steps. Afterwards the whole-model digest is recomputed and compared with the manifest.

Two swap modes. *In place* (``bind=None``): the swap scatters the changed elements into the live tensors
— no extra memory, and fast on a GPU (a scatter at hundreds of GB/s), but on a CPU a few percent of a
1.5 GB model is ~10⁷ elements and the scatter takes a few hundred milliseconds. *Double-buffered*
(``bind`` given, e.g. :func:`bind_module`): the worker keeps a spare copy of the weights, scatters the
update into the spare while generation continues, and the swap only re-points the model's parameters at
the spare (microseconds); afterwards the same update is applied to the old buffer, which becomes the
next spare. It costs one more copy of the weights — the right trade on CPU workers and on GPUs with room.

Anything that does not fit — a gap in the chain (a missed version), a corrupt or missing chunk, a digest
mismatch — makes the worker refuse that delta and *rebuild*: load the newest keyframe at or before the
target and apply the chain of deltas after it, reading manifests from the blob store. A corrupt chunk is
never applied: decoding verifies everything before a single element is written. The same path serves
a late joiner, which starts from the compacted ``rl.weights.latest.v1``.

A worker that comes back far behind — a healed partition, a long stall — finds the versions it missed in
one fetch of the topic and goes straight to the newest (:meth:`WeightSync._newest`): the keyframe and the
deltas after it, their manifests read together and the later versions' chunks downloading while the
earlier ones decode and apply (:attr:`WeightSync.prefetch_bytes` ahead). Stepping through every missed
version instead costs two round trips to the store each: across a 90 ms link, 65 versions took 24 s
where the jump takes under 2 s (``rlbus bench regions``, bench/RESULTS.md).

A blob store that stays down past the client's own retries does not stop the worker either: it keeps
generating on the version it holds, reports how far behind it is (:attr:`WeightSync.behind`, a log
line per attempt) and retries the newest announced version every ``retry_s`` until the store is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from rlbus.blobs.base import BlobStore
from rlbus.bus.base import Bus
from rlbus.bus.topics import WEIGHTS, WEIGHTS_LATEST
from rlbus.bus.types import TopicPartition
from rlbus.errors import (
    BlobNotFound,
    BlobStoreError,
    ChunkCorrupt,
    DigestMismatch,
    RlbusError,
    VersionGap,
    WeightSyncError,
)
from rlbus.metrics import SYNC_REFUSED, count_in, record_sync
from rlbus.models.base import weight_tensors
from rlbus.schemas import WeightVersion, decode
from rlbus.weights.apply import apply_update_
from rlbus.weights.codec import StagedUpdate
from rlbus.weights.codec.warm import warm_kernels
from rlbus.weights.digest import state_digest
from rlbus.weights.layout import manifest_key
from rlbus.weights.staging import SHARED, StagingCache

log = logging.getLogger("rlbus.weights.sync")

SwapRunner = Callable[[Callable[[], None]], Awaitable[None]]


async def _swap_now(fn: Callable[[], None]) -> None:
    fn()


@dataclass(frozen=True)
class SyncStats:
    """One applied version: what it cost and how long the model was paused."""

    version: int
    kind: str
    bytes_fetched: int
    stage_s: float
    swap_pause_s: float
    verify_s: float
    #: manifest creation → swapped and verified, by the trainer's and this worker's clocks
    lag_s: float
    rebuilt: bool
    #: the manifest's creation time (trainer's clock): when the version became fetchable
    manifest_at: float = 0.0


class WeightSync:
    """Keeps ``state`` (the engine's live tensors) bit-identical to the newest published version."""

    def __init__(
        self,
        *,
        bus: Bus,
        store: BlobStore,
        state: MutableMapping[str, torch.Tensor],
        model_id: str = "policy",
        swap: SwapRunner = _swap_now,
        bind: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        on_swap: Callable[[int], None] | None = None,
        fetch_parallelism: int = 8,
        clock: Callable[[], float] = time.time,
        worker_id: str = "",
        staging: StagingCache = SHARED,
    ) -> None:
        """``worker_id`` labels this worker's sync metrics and log lines; ``staging`` decodes each chunk once for
        every worker of the process that holds the same weights (`rlbus.weights.staging`)."""
        self._bus = bus
        self._store = store
        self.worker_id = worker_id
        self.state = state
        self.model_id = model_id
        self._swap = swap
        self._bind = bind
        self._spare: MutableMapping[str, torch.Tensor] | None = (
            {name: t.clone() for name, t in state.items()} if bind is not None else None
        )
        self._on_swap = on_swap
        #: Set once the worker holds its first version: what a rollout worker waits for before it joins.
        self.ready = asyncio.Event()
        self._fetches = asyncio.Semaphore(fetch_parallelism)
        self._staging = staging
        self._clock = clock
        self.version: int | None = None
        self.digest: str | None = None
        self.history: list[SyncStats] = []
        self.refused: list[tuple[int, str]] = []
        #: Newest version announced for this model, and the manifest still to reach when behind.
        self.announced: int | None = None
        self._pending: WeightVersion | None = None
        self.retry_s = 2.0
        #: How many bytes of a rebuild's later versions may be downloaded ahead of the one being applied.
        self.prefetch_bytes = 256 * 2**20

    def stats(self, recent: int = 8) -> dict[str, Any]:
        """What a rollout worker's heartbeat carries about weights: version, bytes, the latest pauses."""
        last = self.history[-1] if self.history else None
        return {
            "version": self.version, "syncs": len(self.history), "refused": len(self.refused),
            "sync_bytes": sum(s.bytes_fetched for s in self.history),
            "swap_pause_ms": [round(s.swap_pause_s * 1000, 3) for s in self.history[-recent:]],
            "stage_s_last": None if last is None else round(last.stage_s, 4),
            "sync_lag_s_last": None if last is None else round(last.lag_s, 3),
        }

    # --- following ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Catch up from the latest manifest, then follow ``rl.weights.v1`` until ``stop`` is set."""
        ends = await self._bus.end_offsets(WEIGHTS.name)  # snapshot first: nothing published after it is lost
        if self.version is None:  # compile the codec before the first version: no JIT pause in a later sync
            dtypes = {t.dtype for t in self.state.values()}
            took = await asyncio.to_thread(warm_kernels, dtypes)
            if took > 1.0:
                log.info("codec kernels ready in %.1f s (%s)", took, ", ".join(sorted(map(str, dtypes))),
                         extra={"worker": self.worker_id})
            await self.catch_up()
        async with self._bus.consumer([WEIGHTS], group=None) as consumer:
            for partition, end in ends.items():
                await consumer.seek(TopicPartition(WEIGHTS.name, partition), end)
            last_try = time.monotonic()
            while not stop.is_set():
                records = await consumer.getmany(timeout_s=0.2)
                if not records and self._pending is not None and time.monotonic() - last_try > self.retry_s:
                    await self.handle(self._pending)  # the store may be back: try the newest version again
                    last_try = time.monotonic()
                manifests = []
                for record in records:
                    last_try = time.monotonic()
                    count_in([record])
                    try:
                        manifests.append(record.value)
                    except RlbusError as exc:
                        log.error("unreadable manifest at %s: %s", record.where, exc,
                                  extra={"topic": record.topic, "partition": record.partition,
                                         "offset": record.offset, "worker": self.worker_id})
                for manifest in self._newest(manifests):
                    await self.handle(manifest)

    def _newest(self, manifests: list[WeightVersion]) -> list[WeightVersion]:
        """This model's manifests of the newest version in one batch (a keyframe version comes as both
        kinds). A batch holds more than one version only when the worker fell behind — a partition healed,
        a long stall — and then stepping through every version, one round trip to the store each, is the
        slow way back: `rebuild` reaches the newest from the keyframe or the chain, whichever it needs."""
        ours = [m for m in manifests if m.model_id == self.model_id]
        if not ours:
            return []
        newest = max(m.version for m in ours)
        skipped = sorted({m.version for m in ours if m.version < newest and m.version > (self.version or 0)})
        if skipped:
            log.info("%s: %d version(s) announced at once (v%d..v%d); going straight to v%d", self.model_id,
                     len(skipped) + 1, skipped[0], newest, newest,
                     extra={"version": newest, "worker": self.worker_id})
        return [m for m in ours if m.version == newest]

    async def catch_up(self) -> bool:
        """Late joiner: rebuild to the manifest in ``rl.weights.latest.v1``; False if none exists yet."""
        latest: WeightVersion | None = None
        async with self._bus.consumer([WEIGHTS_LATEST], group=None) as consumer:
            ends = await self._bus.end_offsets(WEIGHTS_LATEST.name)
            remaining = sum(ends.values())
            deadline = time.monotonic() + 10
            while remaining > 0 and time.monotonic() < deadline:
                records = await consumer.getmany(timeout_s=0.5)
                for record in records:
                    manifest = record.value
                    if manifest.model_id == self.model_id and (latest is None or manifest.version > latest.version):
                        latest = manifest
                positions = [await consumer.position(tp) for tp in consumer.assignment()]
                if sum(positions) >= sum(ends.values()):
                    break
        if latest is None:
            return False
        await self.rebuild(latest.version)
        return True

    async def handle(self, manifest: WeightVersion) -> bool:
        """Apply one announced manifest if it moves this worker forward; True if the version changed."""
        if manifest.model_id != self.model_id or (self.version is not None and manifest.version <= self.version):
            return False
        if self.announced is None or manifest.version > self.announced:
            self.announced, self._pending = manifest.version, manifest
        if manifest.kind == "delta" and manifest.base_version == self.version:
            try:
                await self._apply(manifest, rebuilt=False)
                self._settle()
                return True
            except (WeightSyncError, BlobNotFound, BlobStoreError) as exc:
                self.refused.append((manifest.version, f"{type(exc).__name__}: {exc}"))
                SYNC_REFUSED.labels(self.worker_id).inc()
                log.warning("refused %s v%d: %s; rebuilding from the keyframe", self.model_id, manifest.version, exc)
        try:
            await self.rebuild(manifest.version)
            self._settle()
            return True
        except (WeightSyncError, BlobNotFound, BlobStoreError) as exc:
            self.refused.append((manifest.version, f"rebuild: {type(exc).__name__}: {exc}"))
            SYNC_REFUSED.labels(self.worker_id).inc()
            log.error(
                "cannot reach %s v%d yet (%s); staying on v%s, %d version(s) behind", self.model_id,
                manifest.version, exc, self.version, self.behind,
            )
            return False

    @property
    def behind(self) -> int:
        """Versions announced but not held (what staleness reports show while the store is down)."""
        if self.announced is None:
            return 0
        return self.announced - (self.version or 0)

    def _settle(self) -> None:
        if self._pending is not None and self.version is not None and self._pending.version <= self.version:
            self._pending = None

    # --- rebuilding --------------------------------------------------------------------------------
    async def load_manifest(self, version: int, kind: str) -> WeightVersion:
        return decode(WeightVersion, await self._get(manifest_key(self.model_id, version, kind)))

    async def rebuild(self, target: int) -> None:
        """Reach ``target``: from the held version if the delta chain is intact, else from a keyframe."""
        try:
            final = await self.load_manifest(target, "delta")
        except BlobNotFound:  # the first version (or the first after a trainer restart) is a keyframe only
            final = await self.load_manifest(target, "keyframe")
        if final.kind == "keyframe":
            await self._apply(final, rebuilt=True)
            return
        start = self.version
        chain: list[WeightVersion] = []
        if start is None or start < final.keyframe_version or start > target:
            chain.append(await self.load_manifest(final.keyframe_version, "keyframe"))
            start = final.keyframe_version
        # The manifests between are read together and the chunks of later versions download while earlier
        # ones are decoded and applied, so a chain across a WAN costs a few round trips, not two per
        # version (decoding stays in order: a delta decodes against the weights it follows).
        chain += await asyncio.gather(*(self.load_manifest(v, "delta") for v in range(start + 1, target)))
        if target > start:
            chain.append(final)
        await self._apply_chain(chain)

    async def _apply_chain(self, chain: list[WeightVersion]) -> None:
        """Apply ``chain`` in order while the later versions' chunks download: as many versions ahead as
        ``prefetch_bytes`` holds (always the next one), started in version order so that the fetch
        semaphore serves the oldest first."""
        fetches: dict[int, dict[str, asyncio.Task[bytes]]] = {}
        started, held = 0, 0
        try:
            for i, manifest in enumerate(chain):
                while started < len(chain) and (
                    started <= i + 1 or held + _size(chain[started]) <= self.prefetch_bytes
                ):
                    fetches[started] = {c.key: asyncio.create_task(self._get(c.key)) for c in chain[started].chunks}
                    held += _size(chain[started])
                    started += 1
                await self._apply(manifest, rebuilt=True, fetched=fetches.pop(i))
                held -= _size(manifest)
        finally:  # a chain that stopped early leaves no download running and no failure unretrieved
            left = [task for tasks in fetches.values() for task in tasks.values()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    async def _get(self, key: str) -> bytes:
        async with self._fetches:
            return await self._store.get(key)

    # --- one version -------------------------------------------------------------------------------
    async def stage(
        self, manifest: WeightVersion, fetched: Mapping[str, Awaitable[bytes]] | None = None
    ) -> tuple[list[StagedUpdate], int]:
        """Download, verify and decode every chunk; writes nothing. Returns the updates and bytes fetched.
        ``fetched``: downloads of some chunks already under way (a chain's prefetch), by key."""
        if manifest.kind == "delta" and manifest.base_version != self.version:
            raise VersionGap(
                f"delta v{manifest.version} applies to v{manifest.base_version}, worker holds v{self.version}"
            )
        self._check_layout(manifest)

        base = self.digest if manifest.kind == "delta" else "keyframe"  # what the chunks decode against

        async def one(key: str, expected: str) -> tuple[list[StagedUpdate], int]:
            started = None if fetched is None else fetched.get(key)
            data = await (started if started is not None else self._get(key))
            decode = self._staging.decode
            try:
                return await decode(self.state, data, expected, model_id=self.model_id, version=manifest.version,
                                    base_digest=base), len(data)
            except ChunkCorrupt:
                data = await self._get(key)  # one fresh download: the transport may have damaged it
                return await decode(self.state, data, expected, model_id=self.model_id, version=manifest.version,
                                    base_digest=base), len(data)

        results = await asyncio.gather(*(one(c.key, c.hash) for c in manifest.chunks))
        return [u for updates, _ in results for u in updates], sum(n for _, n in results)

    def _check_layout(self, manifest: WeightVersion) -> None:
        expected = {t.name: (t.dtype, tuple(t.shape)) for t in manifest.tensors}
        held = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in self.state.items()}
        if expected != held:
            missing = sorted(set(expected) ^ set(held)) or sorted(n for n in expected if expected[n] != held.get(n))
            raise WeightSyncError(f"model layout differs from manifest v{manifest.version}: {missing[:5]}")

    async def _apply(
        self, manifest: WeightVersion, *, rebuilt: bool, fetched: Mapping[str, Awaitable[bytes]] | None = None
    ) -> None:
        t0 = time.perf_counter()
        staged, fetched_bytes = await self.stage(manifest, fetched)
        t1 = time.perf_counter()
        pause: list[float] = []
        spare = self._spare
        if spare is None:

            def swap() -> None:
                s = time.perf_counter()
                _scatter(self.state, staged)
                if self._on_swap is not None:
                    self._on_swap(manifest.version)
                pause.append(time.perf_counter() - s)

            await self._swap(swap)
        else:
            assert self._bind is not None
            bind = self._bind
            await asyncio.to_thread(_scatter, spare, staged)

            def flip() -> None:
                s = time.perf_counter()
                bind(spare)
                if self._on_swap is not None:
                    self._on_swap(manifest.version)
                pause.append(time.perf_counter() - s)

            await self._swap(flip)
            self.state, self._spare = spare, self.state
        t2 = time.perf_counter()
        digest = await asyncio.to_thread(state_digest, self.state)
        t3 = time.perf_counter()
        if self._spare is not None:  # bring the old buffer up to this version: it is the next spare
            await asyncio.to_thread(_scatter, self._spare, staged)
        if digest != manifest.model_digest:
            self.version = None  # the held weights are no longer any known version
            self.digest = None
            raise DigestMismatch(
                f"{self.model_id} v{manifest.version}: digest {digest} after applying, manifest says "
                f"{manifest.model_digest}"
            )
        self.version = manifest.version
        self.digest = digest
        self.ready.set()
        stats = SyncStats(
            version=manifest.version,
            kind=manifest.kind,
            bytes_fetched=fetched_bytes,
            stage_s=t1 - t0,
            swap_pause_s=pause[0] if pause else t2 - t1,
            verify_s=t3 - t2,
            lag_s=self._clock() - manifest.created_at,
            rebuilt=rebuilt,
            manifest_at=manifest.created_at,
        )
        self.history.append(stats)
        record_sync(self.worker_id, stats)
        log.info(
            "%s v%d (%s%s): fetched %d B, staged %.3fs, swap pause %.2f ms, verified %.3fs",
            self.model_id, manifest.version, manifest.kind, ", rebuild" if rebuilt else "", fetched_bytes,
            stats.stage_s, stats.swap_pause_s * 1000, stats.verify_s,
            extra={"version": manifest.version, "worker": self.worker_id},
        )


def _size(manifest: WeightVersion) -> int:
    return sum(c.size for c in manifest.chunks)


def _scatter(state: Mapping[str, torch.Tensor], staged: list[StagedUpdate]) -> None:
    with torch.no_grad():
        for update in staged:
            apply_update_(state[update.name], update.update)


def bind_module(module: Any) -> Callable[[Mapping[str, torch.Tensor]], None]:
    """A ``bind`` for a torch module: re-points each parameter at the given tensor (O(1) each). A tied
    parameter is one object under one name (`rlbus.models.base.weight_tensors`), so both uses follow."""
    targets = dict(module.named_parameters())

    def bind(tensors: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in tensors.items():
                targets[name].data = tensor

    return bind


def live_state(module: Any) -> dict[str, torch.Tensor]:
    """The weights of a torch module as weight sync ships them, sharing storage (in-place updates apply)."""
    return weight_tensors(module)
