"""The bus: typed topics over Kafka or the embedded in-memory log, one contract for both."""

from rlbus.bus.base import Bus, Consumer
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topic import Topic
from rlbus.bus.types import Record, RecordMetadata, TopicInfo, TopicPartition, TopicSpec

__all__ = [
    "Bus",
    "Consumer",
    "MemoryBus",
    "Record",
    "RecordMetadata",
    "Topic",
    "TopicInfo",
    "TopicPartition",
    "TopicSpec",
]
