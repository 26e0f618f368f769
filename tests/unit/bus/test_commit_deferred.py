"""A commit the group refuses while it rebalances keeps its positions marked for the next commit, and a
worker's routine commit (``commit_or_defer``) goes on instead of stopping the worker (a rollout worker
died on one when another member left, in the chaos suite's graceful stop)."""

from __future__ import annotations

from typing import Any

import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import PROMPTS, topic_specs
from rlbus.bus.types import TopicPartition
from rlbus.envs.tasks import generate_prompts
from rlbus.errors import CommitFailed


async def test_a_refused_commit_keeps_its_positions_for_the_next_one() -> None:
    bus = MemoryBus(topic_specs(partitions=1))
    async with bus:
        for prompt in generate_prompts("arith", seed=0, n=3, config={"digits": 1}):
            await bus.send(PROMPTS, prompt)
        async with bus.consumer([PROMPTS], group="g") as consumer:
            records = await consumer.getmany(timeout_s=1.0)
            assert len(records) == 3
            refusals = [CommitFailed("the group is rebalancing")]
            commit = consumer._commit

            async def flaky(offsets: dict[TopicPartition, int]) -> Any:
                if refusals:
                    raise refusals.pop()
                return await commit(offsets)

            consumer._commit = flaky  # type: ignore[method-assign]
            consumer.mark(records[0])
            with pytest.raises(CommitFailed):
                await consumer.commit()
            assert await consumer.commit() == {records[0].tp: records[0].offset + 1}  # still marked: retried
            consumer.mark(records[1])
            assert await consumer.commit() == {records[1].tp: records[1].offset + 1}
            refusals.append(CommitFailed("again"))
            consumer.mark(records[2])
            assert await consumer.commit_or_defer() is False  # logged, not raised
            assert await consumer.commit_or_defer() is True
            assert await consumer.committed(records[2].tp) == records[2].offset + 1
