"""The forwarding wrappers pass the whole bus contract through: a method added to Bus or Consumer that
the wrappers do not forward would silently run the base class's default on the wrapper instead."""

from __future__ import annotations

import inspect

import pytest

from rlbus.bus.base import Bus, Consumer
from rlbus.bus.forward import ForwardingBus, ForwardingConsumer
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import PROMPTS
from rlbus.bus.types import TopicPartition, TopicSpec
from rlbus.schemas import Prompt

# Methods built on the others through ``self`` (so the wrapper's forwarding applies to them).
DERIVED = {"send", "commit_or_defer", "__aenter__", "__aexit__"}


def contract(cls: type) -> set[str]:
    return {name for name, member in vars(cls).items() if inspect.isfunction(member) and name not in DERIVED
            and name != "__init__"}


@pytest.mark.parametrize(("base", "wrapper"), [(Bus, ForwardingBus), (Consumer, ForwardingConsumer)])
def test_every_contract_method_is_forwarded(base: type, wrapper: type) -> None:
    missing = contract(base) - set(vars(wrapper))
    assert not missing, f"{wrapper.__name__} does not forward {sorted(missing)}"


async def test_a_wrapped_bus_behaves_as_the_inner_one() -> None:
    inner = MemoryBus()
    async with ForwardingBus(inner) as bus:
        await bus.create_topics([TopicSpec(PROMPTS.name, partitions=3)])
        prompt = Prompt(prompt_id="p1", env="arith", text="1 + 1 = ?", group_size=2)
        meta = await bus.send(PROMPTS, prompt)
        assert (await inner.end_offsets(PROMPTS.name))[meta.partition] == meta.offset + 1
        async with bus.consumer([PROMPTS], group="g") as consumer:
            records = await consumer.getmany(timeout_s=1.0)
            assert [r.value.prompt_id for r in records] == ["p1"]
            consumer.mark(records[0])
            committed = await consumer.commit()
            tp = TopicPartition(PROMPTS.name, meta.partition)
            assert committed == {tp: meta.offset + 1}
            assert await inner.committed("g", PROMPTS.name) == {
                **{p: None for p in await inner.partitions(PROMPTS.name) if p != meta.partition},
                meta.partition: meta.offset + 1,
            }
