"""Weight-sync faults: damaged chunks in the blob store, and the blob store down for a while.

*Corrupt chunk.* :class:`FaultyStore` damages chosen chunks on their way into the store (a flipped bit
at rest, a truncated upload) or on one way out (a flipped bit in flight). Each worker must detect the
damage by the chunk's xxh3-128 before a single element is written, never serve the damaged version,
keep generating on the version it holds, fetch once more (which fixes damage in flight), and otherwise
rebuild from the next keyframe. The upload of the version after each damaged one waits until every
worker has refused the damage, then the scenario adds one prompt and waits for its group, so "kept
generating on the old version" is observed, not left to timing (by then the workers may have played
every prompt the run started with). Every swap records the digest of the weights the engine serves, and
the scenario compares it with the trainer's digest for that version: ``corrupt_applied`` counts
mismatches.

*A stalling store* (:class:`StallingStore`) holds every read until it is let through: the ``worker_lag``
scenario (:mod:`rlbus_tools.chaos.processes`) reads one worker's weights through it.

*Blob store down.* The HTTP blob server stops right after the trainer announced a version and stays
down for a while. The trainer keeps training (publishes are deferred to the next step); the workers'
fetches fail after the client's retries with backoff, they stay on the version they hold, report how
far behind they are, and retry; when the server returns every worker catches up.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from rlbus.aio import until
from rlbus.blobs.base import BlobStore
from rlbus.blobs.http import BlobServer, HttpStore, serve
from rlbus.blobs.local import LocalStore
from rlbus.bus.topics import PROMPTS
from rlbus.envs.tasks import generate_prompts
from rlbus.schemas import WeightVersion, decode
from rlbus.weights import layout
from rlbus_tools.chaos.harness import Run, run_scenario
from rlbus_tools.chaos.ledger import ScenarioReport
from rlbus_tools.chaos.pipeline import Pipeline, PipelineConfig
from rlbus_tools.chaos.rig import ChaosRig
from rlbus_tools.services import free_port

Damage = Callable[[bytes], bytes]


def flip_bit(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0x10
    return bytes(out)


def truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


@dataclass
class FaultyStore(BlobStore):
    """A BlobStore that damages chosen keys at rest (on put) or once in flight (on the first get), and
    keeps the trainer's digest of every version from the manifests written through it."""

    inner: BlobStore
    at_rest: dict[str, Damage] = field(default_factory=dict)
    in_flight: dict[str, Damage] = field(default_factory=dict)
    #: version → the model digest its manifest promises
    truth: dict[int, str] = field(default_factory=dict)
    #: version → monotonic time its manifest was written (the announcement follows at once)
    written_at: dict[int, float] = field(default_factory=dict)
    fired: list[str] = field(default_factory=list)
    #: Awaited after a manifest is stored, before the publisher goes on to announce it.
    after_manifest: Callable[[WeightVersion], Awaitable[None]] | None = None
    #: Awaited before any put (the publisher's upload waits with it).
    before_put: Callable[[str], Awaitable[None]] | None = None

    async def put(self, key: str, data: bytes) -> None:
        if self.before_put is not None:
            await self.before_put(key)
        if key in self.at_rest:
            data = self.at_rest.pop(key)(data)
            self.fired.append(f"at rest: {key}")
        await self.inner.put(key, data)
        if key.rsplit("/", 1)[-1].startswith("manifest."):
            manifest = decode(WeightVersion, data)
            self.truth[manifest.version] = manifest.model_digest
            self.written_at.setdefault(manifest.version, time.monotonic())
            if self.after_manifest is not None:
                await self.after_manifest(manifest)

    async def get(self, key: str) -> bytes:
        data = await self.inner.get(key)
        if key in self.in_flight:
            self.fired.append(f"in flight: {key}")
            return self.in_flight.pop(key)(data)
        return data

    async def get_range(self, key: str, start: int, stop: int) -> bytes:
        return await self.inner.get_range(key, start, stop)

    async def size(self, key: str) -> int:
        return await self.inner.size(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def list(self, prefix: str = "") -> list[str]:
        return await self.inner.list(prefix)

    async def close(self) -> None:
        await self.inner.close()


class StallingStore(LocalStore):
    """The run's blob directory, read through a gate: while ``open`` is clear every read waits (a store
    that stalls: a congested link, a hung relay), so a worker reading through it keeps the weights it
    holds and keeps generating on them."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.open = asyncio.Event()
        self.open.set()
        self.stalled_reads = 0

    async def _gate(self) -> None:
        if not self.open.is_set():
            self.stalled_reads += 1
            await self.open.wait()

    async def get(self, key: str) -> bytes:
        await self._gate()
        return await super().get(key)

    async def get_range(self, key: str, start: int, stop: int) -> bytes:
        await self._gate()
        return await super().get_range(key, start, stop)


def chunk_key(model_id: str, version: int, index: int = 0) -> str:
    return layout.chunk_key(model_id, version, "delta", index)


def made_on(pipeline: Pipeline, version: int, after: float) -> int:
    """Rollouts whose newest token came from ``version``, produced after ``after``."""
    return sum(1 for t, _, v, _ in pipeline.rollouts_made if v == version and t > after)


async def corrupt_chunk(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    # keyframes at v1, 3, 6, 9, 12: damage at rest at v4 (rebuilt at 6) and v8 (rebuilt at 9), in flight at v7
    config = PipelineConfig.seeded(seed, trainer={"keyframe_every": 3}, prompts=26 if quick else 40, weights=True,
                                   model_id=f"chaos-{uuid.uuid4().hex[:6]}")
    store = FaultyStore(LocalStore(rig.home / "blobs" / config.model_id))
    store.at_rest = {chunk_key(config.model_id, 4): flip_bit, chunk_key(config.model_id, 8): truncate}
    store.in_flight = {chunk_key(config.model_id, 7): flip_bit}
    task = config.run.task
    running: list[Run] = []
    holds: dict[int, asyncio.Future[None]] = {}

    async def hold(refused: int) -> None:
        """Until every worker refused ``refused`` and then played one more prompt (on the version it holds)."""
        run = running[0]
        p = run.pipeline
        try:
            await until(lambda: all(any(v == refused and "ChunkCorrupt" in why for v, why in s.refused)
                                    for s in p.syncs), f"every worker refusing v{refused}", timeout_s=120, every_s=0.1)
            since = time.monotonic()
            extra = generate_prompts(task.env, seed=seed + 5000 + refused, n=1, config=task.env_config)[0]
            extra = msgspec.structs.replace(extra, prompt_id=f"{p.run_id}-during-v{refused}-refusal",
                                            group_size=task.group_size)
            await p.bus.send(PROMPTS, extra)
            run.extra_outcomes += task.group_size
            await until(lambda: sum(1 for t, *_ in p.rollouts_made if t > since) >= task.group_size,
                        "a prompt played on the version held", timeout_s=120, every_s=0.1)
        except TimeoutError:
            pass  # let the trainer go on: the scenario's checks will say what did not happen

    async def before_put(key: str) -> None:
        version = int(key.split("/")[1]) if key.startswith(f"{config.model_id}/") else 0
        if version in (5, 9) and running:
            if version not in holds:
                holds[version] = asyncio.ensure_future(hold(version - 1))
            await holds[version]

    store.before_put = before_put

    async def fault(run: Run) -> None:
        p, report = run.pipeline, run.report
        running.append(run)
        report.faults += ["bit flipped at rest: delta v4", "bit flipped in flight (first read): delta v7",
                          "truncated at rest: delta v8"]
        await until(lambda: min((s.version or 0) for s in p.syncs) >= 10, "every worker on v10", timeout_s=240,
                    every_s=0.1)
        report.check("all three faults fired", len(store.fired) == 3)
        refused = {v for s in p.syncs for v, why in s.refused if "ChunkCorrupt" in why}
        report.check("damage at rest detected by hash (v4, v8)", {4, 8} <= refused)
        report.check("damage in flight fixed by a fresh read (v7 not refused)", 7 not in refused)
        for version, keyframe in ((4, 6), (8, 9)):
            on_old = made_on(p, version - 1, store.written_at.get(version, float("inf")))
            report.check(f"kept generating on v{version - 1} while v{version} was refused", on_old > 0)
            report.extra[f"rollouts_on_v{version - 1}_meanwhile"] = on_old
            report.check(
                f"rebuilt from keyframe v{keyframe}",
                all(any(h.version == keyframe and h.rebuilt for h in s.history) for s in p.syncs),
            )
        served = [p.first_served(i, 4) for i in range(len(p.syncs))]
        if all(t is not None for t in served):
            report.recovery_s = max(t for t in served if t is not None) - store.written_at[4]
        report.notes.append("recovery = corrupt v4 announced → every worker serving a verified version ≥ 4")

    return await run_scenario(rig, "corrupt_chunk", config=config, fault=fault, store=store, truth=store.truth)


class _Server:
    """The HTTP blob server, stoppable and restartable on the same port."""

    def __init__(self, root: Path, secret: str) -> None:
        self.server = BlobServer(LocalStore(root), secret=secret)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: object | None = None

    async def up(self) -> None:
        self.runner = await serve(self.server, "127.0.0.1", self.port)

    async def down(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()  # type: ignore[attr-defined]
            self.runner = None


async def blob_store_down(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    down_s = 6.0 if quick else 12.0
    config = PipelineConfig.seeded(seed, trainer={"keyframe_every": 3}, prompts=24 if quick else 40, weights=True,
                                   model_id=f"chaos-{uuid.uuid4().hex[:6]}")
    secret = uuid.uuid4().hex
    http = _Server(rig.home / "blob-server" / config.model_id, secret)
    await http.up()
    written, down = asyncio.Event(), asyncio.Event()
    store = FaultyStore(HttpStore(http.url, secret=secret, retries=3, backoff_s=0.05, timeout_s=5))

    async def after_manifest(manifest: WeightVersion) -> None:
        if manifest.version == 4 and manifest.kind == "delta":  # v4 is no keyframe: its delta manifest is last
            written.set()
            await down.wait()  # v4 is announced only once the server is down: workers find it unreachable

    store.after_manifest = after_manifest

    async def fault(run: Run) -> None:
        p, report = run.pipeline, run.report
        await written.wait()
        await http.down()
        down.set()
        down_at = time.monotonic()
        report.faults.append(f"blob server down right after v4 was written, for {down_s:.0f} s")
        behind = 0
        while time.monotonic() - down_at < down_s:
            behind = max(behind, *(s.behind for s in p.syncs))
            await asyncio.sleep(0.1)
        deferred = sum(1 for m in p.trainer_worker.steps if m.get("published") is False)
        await http.up()
        up_at = time.monotonic()
        report.faults.append("blob server back")
        report.check("workers reported being behind while the store was down", behind >= 1)
        report.extra.update(max_versions_behind=behind, publishes_deferred=deferred,
                            fetch_refusals=sum(len(s.refused) for s in p.syncs))
        # The trainer may have finished its steps during the outage: then v4 is its newest version, and the
        # workers must reach it by their own retries.
        await until(lambda: p.trainer.version >= 4 and all(s.version == p.trainer.version for s in p.syncs),
                    "every worker on the trainer's newest version", timeout_s=120, every_s=0.1)
        report.recovery_s = time.monotonic() - up_at
        report.check("every worker caught up with the trainer", True)
        report.notes.append("recovery = blob server back → every worker on the trainer's newest version")

    try:
        return await run_scenario(rig, "blob_store_down", config=config, fault=fault, store=store, truth=store.truth)
    finally:
        await store.close()
        await http.down()
