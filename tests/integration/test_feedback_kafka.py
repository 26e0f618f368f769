"""The feedback API over a real broker: a posted signal is acknowledged with its place on the log, and
the Reward read back from that place is the user's."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from rlbus.bus import Topic, TopicPartition, TopicSpec
from rlbus.producers.feedback import FeedbackServer
from rlbus.schemas import Reward
from tests.conftest import kafka_bus

TOKEN = "kafka-feedback-test-token"


async def test_feedback_lands_on_kafka_where_the_reply_says() -> None:
    topic = Topic(f"test.feedback.{uuid.uuid4().hex[:8]}", Reward, key=lambda m: m.rollout_id)
    bus = await kafka_bus()  # started already
    try:
        await bus.create_topics([TopicSpec(topic.name, partitions=3)])
        server = FeedbackServer(bus=bus, token=TOKEN, topic=topic)
        async with TestClient(TestServer(server.app())) as client:
            response = await client.post(
                "/v1/feedback:batch",
                json=[{"rollout_id": "p-1/0", "signal": "up", "user": "ann", "comment": "solved it"},
                      {"rollout_id": "p-1/1", "signal": "down", "score": 0.3, "user": "ann"}],
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert response.status == 202, await response.text()
            receipts: list[dict[str, Any]] = (await response.json())["results"]

        starts: dict[int, int] = {}
        for receipt in receipts:
            assert receipt["topic"] == topic.name
            starts[receipt["partition"]] = min(receipt["offset"], starts.get(receipt["partition"], receipt["offset"]))
        async with bus.consumer([topic]) as consumer:
            for partition, offset in starts.items():
                await consumer.seek(TopicPartition(topic.name, partition), offset)
            found: dict[str, Reward] = {}
            deadline = time.monotonic() + 15
            while len(found) < 2 and time.monotonic() < deadline:
                for record in await consumer.getmany(timeout_s=0.5):
                    found[f"{record.partition}@{record.offset}"] = record.value
    finally:
        await bus.close()
    first, second = (found[f"{r['partition']}@{r['offset']}"] for r in receipts)
    assert (first.reward_id, first.source, first.value, first.reason) == ("p-1/0:user:ann", "user", 1.0, "solved it")
    assert (second.rollout_id, second.prompt_id, second.value) == ("p-1/1", "p-1", 0.3)
