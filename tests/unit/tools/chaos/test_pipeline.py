"""The chaos loop (`rlbus_tools.chaos.pipeline`) is a run config: the builders' argument functions read its knobs as
every role's, and the loop runs on the in-memory bus as on the chaos rig's Kafka."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlbus.state.memory import MemoryStateStore
from rlbus.wiring.infra import open_bus, open_store
from rlbus_tools.chaos.pipeline import CHAOS_RUN, TINY, Pipeline, PipelineConfig


def test_a_scenario_tunes_the_loops_run_config() -> None:
    config = PipelineConfig.seeded(3, trainer={"keyframe_every": 5}, prompts=4)
    run = config.run
    assert (run.task.seed, run.trainer.keyframe_every, config.prompts) == (3, 5, 4)
    assert run.trainer.grpo == CHAOS_RUN.trainer.grpo and run.model.options == TINY and run.task.group_size == 4
    assert PipelineConfig().run == CHAOS_RUN


async def test_the_loop_trains_every_rollout_once_with_its_run_configs_knobs(tmp_path: Path) -> None:
    config = PipelineConfig.seeded(1, trainer={"keyframe_every": 5}, prompts=4, weights=True)
    bus = open_bus(None, partitions=2)
    await bus.start()
    pipeline = Pipeline(bus=bus, state=MemoryStateStore(), config=config, run_id="unit",
                        store=open_store(str(tmp_path / "blobs")))
    assert pipeline.publisher is not None and pipeline.publisher.keyframe_every == 5
    assert pipeline.trainer.grpo.max_staleness == 1_000_000 and pipeline.trainer_worker.groups_per_step == 2
    assert pipeline.expected == 16
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop))
    try:
        assert await pipeline.wait_outcomes(pipeline.expected, timeout_s=120)
    finally:
        stop.set()
        await task
        await bus.close()
    assert pipeline.join.trained_twice == 0 and pipeline.trainer.version >= 2
