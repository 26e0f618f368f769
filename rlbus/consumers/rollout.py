"""The rollout worker: prompts in, agent episodes out, weights following the trainer as they go.

Any number of these join the consumer group ``rollout`` on ``rl.prompts.v1``, in any region (the region
becomes the Kafka client id suffix and ``client.rack``). For each prompt the worker plays ``group_size``
episodes concurrently in the prompt's environment — each episode on its own thread, their model calls
merged into shared batches by :class:`rlbus.engines.batching.BatchingEngine` — and publishes one
``Rollout`` per episode, stamped with the policy version of every token. Episode ids are derived from
the prompt id and group index, so a prompt redelivered after a crash produces the same rollout ids and
the trainer's ledger keeps it from being trained twice.

Generation runs on threads (the process entry point sizes the default executor for all concurrent
episodes: :func:`episode_threads`), so the event loop keeps serving group heartbeats and the weight-sync task
(:class:`rlbus.weights.sync.WeightSync`), which stages new versions meanwhile and swaps them in at the
engine's next step boundary. A prompt that cannot be played (unknown environment, bad config) goes to
the DLQ with the reason.

Prompts play in a sliding window: up to ``prompts_in_flight`` at once, and the moment one is published
(or dead-lettered) the next is taken, so one long episode (tool calls, a long answer) holds up one slot
rather than a whole batch. Prompts finish out of order but commits stay in order
(:class:`rlbus.bus.inflight.InFlight`): the committed offset never passes a prompt still playing, so a
crash redelivers every unfinished prompt (and possibly some finished ones, whose rollout ids repeat).
On ``stop`` the worker takes no new prompt, lets the ones in play finish, commits and returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rlbus.bus.base import Bus
from rlbus.bus.dlq import DeadLetters, handle_record
from rlbus.bus.inflight import InFlight
from rlbus.bus.topics import PROMPTS, ROLLOUTS
from rlbus.bus.types import Record
from rlbus.engines.base import Engine
from rlbus.envs.agent import run_episode
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import episode_to_rollout
from rlbus.errors import ConfigError
from rlbus.metrics import POLICY_VERSION, count_in, observe_processing
from rlbus.observe.lag import LagProbe
from rlbus.observe.logs import record_fields
from rlbus.schemas import Prompt, Rollout, SamplingInfo

log = logging.getLogger("rlbus.consumers.rollout")

GROUP = "rollout"


def episode_threads(n: int = 64) -> None:
    """Give the running loop's default executor room for ``n`` concurrent episodes (asyncio's default
    of cpu_count + 4 threads would cap a group's batch at 6 on a 2-core machine)."""
    from concurrent.futures import ThreadPoolExecutor

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(n, thread_name_prefix="episode"))


class RolloutWorker:
    def __init__(
        self,
        *,
        bus: Bus,
        engine: Engine,
        chat: ChatFormat,
        worker_id: str,
        region: str = "",
        model_id: str = "policy",
        sampling: SamplingInfo | None = None,
        prompts_in_flight: int = 2,
        static_membership: bool = False,
        on_rollout: Callable[[Rollout], None] | None = None,
        on_policy: bool = False,
        clock: Callable[[], float] = time.time,
        commit_interval_s: float = 1.0,
    ) -> None:
        """``on_policy``: before playing a prompt, wait until the engine serves the policy version the
        prompt was admitted at (synchronous RL, the baseline of ``rlbus bench pipeline``).
        ``commit_interval_s``: commit the finished prefix at most this often while running (and always
        on stop); a crash replays at most that much finished work, and the broker sees few commits."""
        self._bus = bus
        self.engine = engine
        self._chat = chat
        self.worker_id = worker_id
        self.region = region
        self.model_id = model_id
        self.sampling = sampling or SamplingInfo(temperature=1.0)
        if prompts_in_flight < 1:
            raise ConfigError("prompts_in_flight", f"must be at least 1, got {prompts_in_flight}")
        self._prompts_in_flight = prompts_in_flight
        self._commit_interval_s = commit_interval_s
        self._instance_id = worker_id if static_membership else None
        self._on_rollout = on_rollout
        self._clock = clock
        self.dead_letters = DeadLetters(bus)
        self.on_policy = on_policy
        self.rollouts = 0
        self.busy_s = 0.0
        #: Seconds with at least one prompt in play (``busy_s`` sums per-prompt times, which overlap).
        self.active_s = 0.0
        self._in_play = 0
        self._active_since = 0.0
        self.lag_probe = LagProbe()
        #: Set once the group has given this worker partitions. A driver that starts the prompt producer
        #: before every worker has joined lets the first one take every partition's prompts.
        self.joined = asyncio.Event()

    def stats(self) -> dict[str, Any]:
        """What this worker's heartbeat carries (``processed`` = rollouts published)."""
        return {
            "group": GROUP, "topics": [PROMPTS.name], "processed": self.rollouts, "rollouts": self.rollouts,
            "busy_s": round(self.busy_s, 3), "version": self.engine.policy_version,
            "dead_letters": sum(self.dead_letters.counts.values()), "lag": self.lag_probe.total,
        }

    async def play(self, prompt: Prompt) -> list[Rollout]:
        """All ``group_size`` episodes of one prompt, as rollouts (not yet published)."""
        env = env_for(prompt)
        episodes = await asyncio.gather(
            *(
                run_episode(
                    env, prompt, engine=self.engine, chat=self._chat, sampling=self.sampling,
                    episode_id=f"{prompt.prompt_id}/{i}",
                )
                for i in range(prompt.group_size)
            )
        )
        return [
            episode_to_rollout(
                episode, prompt=prompt, group_index=i, model_id=self.model_id, worker_id=self.worker_id,
                region=self.region, created_at=self._clock(),
            )
            for i, episode in enumerate(episodes)
        ]

    async def _handle(self, record: Record[Any]) -> None:
        prompt: Prompt = record.value
        while self.on_policy and self.engine.policy_version < prompt.policy_version:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        started = time.perf_counter()
        self._enter_play(started)
        try:
            rollouts = await self.play(prompt)
        finally:
            self._leave_play()
        for rollout in rollouts:
            await self._bus.send(ROLLOUTS, rollout)
            self.rollouts += 1
            if self._on_rollout is not None:
                self._on_rollout(rollout)
        self.busy_s += time.perf_counter() - started
        observe_processing("rollout", started)
        POLICY_VERSION.labels(self.worker_id).set(self.engine.policy_version)
        log.info(
            "%s: prompt %s (%s) → %d rollouts at policy v%d in %.2fs",
            record.where, prompt.prompt_id, prompt.env, len(rollouts), self.engine.policy_version,
            time.perf_counter() - started,
            extra=record_fields(
                record, prompt_id=prompt.prompt_id, version=self.engine.policy_version, worker=self.worker_id
            ),
        )

    def _enter_play(self, now: float) -> None:
        if self._in_play == 0:
            self._active_since = now
        self._in_play += 1

    def _leave_play(self) -> None:
        self._in_play -= 1
        if self._in_play == 0:
            self.active_s += time.perf_counter() - self._active_since

    async def run(self, stop: asyncio.Event) -> None:
        async with self._bus.consumer([PROMPTS], group=GROUP, instance_id=self._instance_id) as consumer:
            window = InFlight(consumer)
            playing: dict[asyncio.Task[None], Record[Any]] = {}
            committed_at = time.monotonic()
            try:
                while not stop.is_set():
                    if not self.joined.is_set() and consumer.assignment():
                        self.joined.set()
                    await self.lag_probe.refresh(consumer)
                    window.forget_revoked()
                    free = self._prompts_in_flight - len(playing)
                    if free > 0:
                        records = await consumer.getmany(timeout_s=0.2, max_records=free)
                        if not stop.is_set():  # fetched but never taken: redelivered, the commit stops short
                            self._take(records, playing, window)
                    else:
                        await asyncio.wait(playing, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
                    self._reap(playing, window)
                    if time.monotonic() - committed_at >= self._commit_interval_s:
                        await consumer.commit_or_defer()
                        committed_at = time.monotonic()
                while playing:  # graceful drain: no new prompts, the ones in play finish
                    await asyncio.wait(playing, return_when=asyncio.FIRST_COMPLETED)
                    window.forget_revoked()
                    self._reap(playing, window)
                await consumer.commit_or_defer()  # refused in a rebalance: close() commits what is still ours
            finally:
                for task in playing:
                    task.cancel()
                await asyncio.gather(*playing, return_exceptions=True)

    def _take(
        self, records: list[Record[Any]], playing: dict[asyncio.Task[None], Record[Any]], window: InFlight
    ) -> None:
        """Start playing each record; the same per-record handling as every worker (retries, the DLQ)."""
        count_in(records)
        for record in records:
            window.take(record)
            task = asyncio.create_task(handle_record(record, self._handle, self.dead_letters))
            playing[task] = record

    @staticmethod
    def _reap(playing: dict[asyncio.Task[None], Record[Any]], window: InFlight) -> None:
        """Retire the finished prompts. An outage one of them raised (:func:`rlbus.bus.dlq.is_outage`)
        stops the worker: ``run`` cancels the rest, and nothing unfinished is ever marked."""
        for task in [t for t in playing if t.done()]:
            record = playing.pop(task)
            task.result()
            window.finish(record)
