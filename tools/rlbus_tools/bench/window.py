"""``rlbus bench window``: what the rollout worker's sliding window buys over playing prompts in batches.

Agent episodes vary a lot in length (tool calls, long answers), so a worker that takes
``prompts_in_flight`` prompts, plays them together and only then takes the next batch leaves its engine
partly idle while each batch waits for its slowest prompt. The worker now keeps a window instead: the
moment one prompt is published the next one starts (:mod:`rlbus.consumers.rollout`).

One :class:`RolloutWorker` on the in-memory bus plays the same prompts twice — once with the batch loop
it used to run (kept here only as the same-run baseline, :class:`BatchLoopWorker`), once with its own
window. Episodes go through the real harness (environment, agent loop, rollout conversion, publishing);
only the engine is fake: it answers after a heavy-tailed, seeded delay (lognormal, keyed by the prompt's
tokens, so both loops see identical episode times) and sleeps rather than computes, so the figures are
about scheduling, not about this machine's CPU. Each prompt asks for one episode.

Figures per loop: prompts/s; the engine-idle fraction ``1 − Σ episode time / (slots × wall)`` with
``slots = prompts_in_flight`` (the share of generation slots left empty, which a batching engine turns
into lost throughput); and the ratio of the wall time to the perfect-packing bound ``Σ episode time /
slots``.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from msgspec.structs import replace

from rlbus.bus.dlq import handle_batch
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import PROMPTS, topic_specs
from rlbus.consumers.rollout import GROUP, RolloutWorker, episode_threads
from rlbus.engines.base import GenerationRequest, GenerationResult, LogprobSpec
from rlbus.envs.chat import ChatFormat
from rlbus.envs.tasks import generate_prompts
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.schemas import Rollout
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json

#: Median episode time and the lognormal's sigma (sigma 1: mean ≈ 1.65 × median, p99 ≈ 10 × median).
MEDIAN_S = 0.05
SIGMA = 1.0
PROMPTS_IN_FLIGHT = 4


class TailEngine:
    """An engine whose every answer takes a lognormal time, the same for the same prompt tokens and seed.

    Thread-safe; adds up the time it spent generating (what the idle fraction is computed from)."""

    def __init__(self, tokenizer: ByteTokenizer, *, seed: int, median_s: float, sigma: float) -> None:
        self._tokenizer = tokenizer
        self._seed = seed
        self._median_s = median_s
        self._sigma = sigma
        self._lock = threading.Lock()
        self._busy: list[float] = []

    @property
    def busy_s(self) -> float:
        """Seconds spent generating, summed exactly (``math.fsum``): the same episodes give the same total
        whatever order they finished in (float ``+=`` differs in the last bit between orders)."""
        with self._lock:
            return math.fsum(self._busy)

    @property
    def policy_version(self) -> int:
        return 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        raise NotImplementedError("the benchmark engine has no weights")

    def duration(self, prompt_ids: Sequence[int]) -> float:
        key = zlib.crc32(bytes(i % 256 for i in prompt_ids)) ^ self._seed
        return self._median_s * math.exp(self._sigma * random.Random(key).gauss(0.0, 1.0))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return [self._one(r) for r in requests]

    def _one(self, request: GenerationRequest) -> GenerationResult:
        seconds = self.duration(request.prompt_ids)
        time.sleep(seconds)
        with self._lock:
            self._busy.append(seconds)
        ids = [*self._tokenizer.encode("<answer>7</answer>"), *request.stop_token_ids[:1]]
        return GenerationResult(
            request_id=request.request_id, prompt_ids=request.prompt_ids, token_ids=tuple(ids),
            logprobs=torch.zeros(len(ids)), policy_versions=(0,) * len(ids), text="<answer>7</answer>",
            finish_reason="stop", logprob_spec=LogprobSpec(request.temperature, request.top_p, request.top_k),
        )


class BatchLoopWorker(RolloutWorker):
    """The loop the rollout worker ran before its window, kept only as this benchmark's baseline: take up
    to ``prompts_in_flight`` prompts, play them together, commit, take the next batch."""

    async def run(self, stop: asyncio.Event) -> None:
        async with self._bus.consumer([PROMPTS], group=GROUP) as consumer:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_s=0.2, max_records=self._prompts_in_flight)
                if batch:
                    await handle_batch(consumer, batch, self._handle, self.dead_letters, concurrency=len(batch))
                    await consumer.commit()


async def measure(loop: str, n: int, *, seed: int, in_flight: int, median_s: float, sigma: float) -> dict[str, Any]:
    """Play ``n`` prompts with one worker running ``loop`` ("batch" or "window"); its figures."""
    tokenizer = ByteTokenizer()
    engine = TailEngine(tokenizer, seed=seed, median_s=median_s, sigma=sigma)
    bus = MemoryBus(topic_specs(partitions=4))
    await bus.start()
    for prompt in generate_prompts("arith", seed=seed, n=n):
        await bus.send(PROMPTS, replace(prompt, group_size=1))
    done = asyncio.Event()
    published: list[float] = []

    def on_rollout(rollout: Rollout) -> None:
        published.append(time.perf_counter())
        if len(published) == n:
            done.set()

    kind = BatchLoopWorker if loop == "batch" else RolloutWorker
    worker = kind(
        bus=bus, engine=engine, chat=ChatFormat.for_byte_tokenizer(tokenizer), worker_id=f"bench-{loop}",
        prompts_in_flight=in_flight, on_rollout=on_rollout,
    )
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(worker.run(stop))
    await done.wait()
    wall = published[-1] - started
    stop.set()
    await task
    committed = sum(v or 0 for v in (await bus.committed(GROUP, PROMPTS.name)).values())
    await bus.close()
    return {
        "prompts": n,
        "committed": committed,
        "wall_s": wall,
        "prompts_per_s": n / wall,
        "engine_busy_s": engine.busy_s,
        "engine_idle_fraction": 1.0 - engine.busy_s / (in_flight * wall),
        "wall_over_packing_bound": wall / (engine.busy_s / in_flight),
    }


async def _run(quick: bool, seed: int) -> dict[str, Any]:
    episode_threads(64)
    n = 40 if quick else 200
    figures = {
        loop: await measure(loop, n, seed=seed, in_flight=PROMPTS_IN_FLIGHT, median_s=MEDIAN_S, sigma=SIGMA)
        for loop in ("batch", "window")
    }
    config = {"prompts": n, "seed": seed, "in_flight": PROMPTS_IN_FLIGHT, "median_s": MEDIAN_S, "sigma": SIGMA}
    return {**figures, "config": config}


def run(quick: bool, json_path: Path | None, seed: int = 0) -> dict[str, Any]:
    result = asyncio.run(_run(quick, seed))
    b, w = result["batch"], result["window"]
    result["window_vs_batch_throughput"] = w["prompts_per_s"] / b["prompts_per_s"]
    result["meta"] = {**meta(), "quick": quick}
    c = result["config"]
    print_table(
        f"rlbus bench window — {c['prompts']} prompts, {c['in_flight']} in flight, "
        f"lognormal episodes (median {c['median_s'] * 1000:.0f} ms, sigma {c['sigma']})",
        ["loop", "prompts/s", "wall s", "engine idle", "wall / packing bound"],
        [
            [name, f["prompts_per_s"], f["wall_s"], f["engine_idle_fraction"], f["wall_over_packing_bound"]]
            for name, f in (("batch (before)", b), ("window", w))
        ],
    )
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """Rollout workers' sliding window against batch-at-a-time generation."""
    run(quick=quick, json_path=json_path)
