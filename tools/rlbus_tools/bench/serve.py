"""``rlbus bench serve``: what the OpenAI-compatible gateway costs over calling the engine, and how fast
served completions reach Kafka.

Latency and throughput. The same requests — one chat prompt rendered by the model's template, a fixed
``max_tokens``, request i sampled with seed i — are run two ways at concurrency 1, 8 and 32, in one
process and one run:

* **direct** (the same-run baseline): c threads call the rollout stack's batching engine, each request
  one ``generate`` — what a rollout worker does;
* **gateway**: c asyncio tasks of the official ``openai`` client (``AsyncOpenAI``) post to the gateway,
  which runs on its own event loop thread over that same engine and records every completion.

Seeds make both paths sample the same tokens (checked: ``same_tokens``), so the difference is the
gateway: HTTP, JSON, validation, rendering, recording — and the client library, which shares the
process (and its GIL) with the gateway. Each level runs in rounds that alternate which path goes
first, latencies pooled, because a shared machine drifts. Reported per level: requests/s, p50/p99
latency, ``overhead_p50 = gateway p50 / direct p50 − 1``, and the gateway's *own* time per request
(``own_p50_ms``: its handling minus the engine call, measured inside the gateway, so it does not move
with the engine's load) as a share of the direct p50 (``own_share_p50``). Target: overhead ≤ 10 % of
p50 at concurrency 8.

Recording. Every completion of the gateway runs must be on ``rl.served.v1`` (``recorded`` vs
``served``). Then a burst of N records (copies of a real one, distinct ids) is flushed through the
recorder — batched sends in flight — against one-at-a-time acknowledged sends of the same records as
the baseline: records/s for both. Kafka at ``bootstrap`` (topics under a fresh namespace); if it is not
reachable the in-memory bus is used and the JSON says so.

The online-learning run (simulated users' thumbs on served answers, held-out accuracy over versions) is
a benchmark of its own, ``rlbus bench online`` (tools/rlbus_tools/bench/online.py): it trains for minutes, so it does
not ride along with the latency figures here.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rlbus.bus.base import Bus
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, SERVED, topic_specs
from rlbus.engines.base import GenerationRequest
from rlbus.errors import BusUnavailable
from rlbus.observe.stats import percentile
from rlbus.schemas import Served
from rlbus.serve.auth import Tenants
from rlbus.serve.recorder import ServedRecorder
from rlbus.serve.stack import ServeStack, serve_stack
from rlbus_tools.bench.common import Bootstrap, JsonPath, Quick, meta, print_table, write_json

TOKEN = "bench-serve-token-0123456789"
PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


@dataclass(frozen=True)
class Setup:
    model: str
    levels: tuple[int, ...]
    requests: dict[int, int]
    """Requests per concurrency level, per path and round."""
    rounds: int
    """Rounds per level, alternating which path goes first; latencies are pooled over the rounds."""
    max_tokens: int
    records: int


FULL = Setup(model="smollm2-135m-instruct", levels=(1, 8, 32), requests={1: 6, 8: 24, 32: 64}, rounds=3,
             max_tokens=16, records=2000)
QUICK = Setup(model="tiny", levels=(1, 8, 32), requests={1: 4, 8: 16, 32: 32}, rounds=2, max_tokens=8, records=300)


class _GatewayThread:
    """The gateway (and its bus) on an event loop of its own, as a server process would run it."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stack: ServeStack | None = None
        self.bus: Bus | None = None
        self.kafka = False
        self.url = ""
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="gateway", daemon=True)

    def __enter__(self) -> _GatewayThread:
        self._thread.start()
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to the caller waiting on ``ready``
            self.error = exc
            self.ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self.bus, self.kafka = await self._make()
        try:
            self.stack = stack = _stack(self.bus)
            task = asyncio.create_task(stack.gateway.run(self._stop, "127.0.0.1", 0))
            await stack.gateway.listening.wait()
            host, port = stack.gateway.address or ("", 0)
            self.url = f"http://{host}:{port}/v1"
            self.ready.set()
            await task
        finally:
            await self.bus.close()


_SOURCE: Any = None


def _stack(bus: Bus) -> ServeStack:
    return serve_stack(bus=bus, source=_SOURCE, tenants=Tenants({"bench": TOKEN}), model_name="bench",
                       max_batch=32, buffer_records=100_000)


async def _open_bus(bootstrap: str) -> tuple[Bus, bool]:
    """Kafka under a fresh namespace with the gateway's topics, else the in-memory bus."""
    from rlbus.bus.kafka import KafkaBus, KafkaSettings
    from rlbus.bus.namespace import NamespacedBus

    names = {SERVED.name, ROLLOUTS.name, REWARDS.name}
    specs = [s for s in topic_specs() if s.name in names]
    kafka = NamespacedBus(KafkaBus(KafkaSettings(bootstrap=bootstrap, client_id="rlbus-bench-serve")),
                          f"bench-serve-{uuid.uuid4().hex[:8]}.")
    try:
        await kafka.start()
        await kafka.create_topics(specs)
        return kafka, True
    except BusUnavailable:
        await kafka.close()
        memory = MemoryBus(specs)
        await memory.start()
        return memory, False


@dataclass
class _Pool:
    """One path's latencies and per-request token counts, pooled over the rounds of a level."""

    latencies: list[float]
    wall_s: float
    tokens: dict[int, int]

    def add(self, other: _Pool) -> _Pool:
        return _Pool(self.latencies + other.latencies, self.wall_s + other.wall_s, {**self.tokens, **other.tokens})

    def figures(self) -> dict[str, Any]:
        return {
            "requests": len(self.latencies), "requests_per_s": len(self.latencies) / self.wall_s,
            "p50_ms": percentile(self.latencies, 50) * 1000, "p99_ms": percentile(self.latencies, 99) * 1000,
            "tokens": sum(self.tokens.values()),
        }


def _direct(stack: ServeStack, concurrency: int, seeds: range, max_tokens: int) -> _Pool:
    """c threads calling the batching engine, request i with seed i."""
    chat = stack.rollout.chat
    prompt, _ = chat.render_messages(PROMPT)
    prompt_ids = (*prompt, *chat.model_header)
    engine = stack.rollout.batching
    latencies: list[float] = []
    tokens: dict[int, int] = {}

    def one(i: int) -> None:
        request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_tokens, stop_token_ids=chat.stop_ids,
                                    seed=i, request_id=f"direct-{i}")
        t = time.perf_counter()
        [result] = engine.generate([request])
        latencies.append(time.perf_counter() - t)
        tokens[i] = len(result.token_ids)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, seeds))
    return _Pool(latencies, time.perf_counter() - start, tokens)


async def _gateway(url: str, concurrency: int, seeds: range, max_tokens: int) -> _Pool:
    """c tasks of the openai client, request i with seed i."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=600)
    latencies: list[float] = []
    tokens: dict[int, int] = {}
    queue = list(seeds)

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            t = time.perf_counter()
            reply = await client.chat.completions.create(model="bench", messages=PROMPT,  # type: ignore[arg-type]
                                                         max_tokens=max_tokens, seed=i)
            latencies.append(time.perf_counter() - t)
            tokens[i] = reply.usage.completion_tokens if reply.usage else 0

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return _Pool(latencies, wall, tokens)


async def _recording(bus: Bus, sample: Served, n: int) -> dict[str, Any]:
    """records/s: N records through the recorder (batched), and sent one at a time (the baseline)."""
    copies = [msgspec.structs.replace(sample, served_id=f"bench-{uuid.uuid4().hex[:12]}") for _ in range(2 * n)]
    recorder = ServedRecorder(bus=bus, capacity=2 * n, batch=256)
    start = time.perf_counter()
    for record in copies[:n]:
        recorder.record(record)
    assert await recorder.flush()
    batched = n / (time.perf_counter() - start)
    start = time.perf_counter()
    for record in copies[n:]:
        await bus.send(SERVED, record)
    sequential = n / (time.perf_counter() - start)
    return {"records": n, "records_per_s": batched, "sequential_records_per_s": sequential,
            "record_bytes": len(msgspec.msgpack.encode(sample))}


async def _last_served(bus: Bus) -> Served:
    async with bus.consumer([SERVED], group=None) as consumer:
        while True:
            records = await consumer.getmany(timeout_s=1.0)
            if records:
                value: Served = records[-1].value
                return value


def run(quick: bool = False, json_path: Path | None = None, bootstrap: str = "127.0.0.1:9092") -> dict[str, Any]:
    import torch
    from rich.console import Console

    from rlbus.models.sources import parse_model

    global _SOURCE
    progress = Console(stderr=True)
    setup = QUICK if quick else FULL
    _SOURCE = parse_model(setup.model, device="cpu")
    torch.manual_seed(0)
    levels: dict[str, Any] = {}
    with _GatewayThread(lambda: _open_bus(bootstrap)) as server:
        stack = server.stack
        assert stack is not None and server.bus is not None
        _direct(stack, 2, range(2), setup.max_tokens)  # warm-up: first forward passes, threads, connections
        asyncio.run(_gateway(server.url, 2, range(2), setup.max_tokens))
        for c in setup.levels:
            n = setup.requests[c]
            direct, gateway = _Pool([], 0.0, {}), _Pool([], 0.0, {})
            stack.gateway.own_seconds.clear()
            for r in range(setup.rounds):  # alternate the order, so drift on a shared machine hits both
                progress.print(f"[dim]concurrency {c}: round {r + 1}/{setup.rounds}, {n} requests per path[/dim]")
                seeds = range(r * n, (r + 1) * n)
                for path in (("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")):
                    if path == "direct":
                        direct = direct.add(_direct(stack, c, seeds, setup.max_tokens))
                    else:
                        gateway = gateway.add(asyncio.run(_gateway(server.url, c, seeds, setup.max_tokens)))
            d, g = direct.figures(), gateway.figures()
            own = percentile(list(stack.gateway.own_seconds), 50) * 1000
            levels[str(c)] = {"direct": d, "gateway": g, "same_tokens": direct.tokens == gateway.tokens,
                              "overhead_p50": g["p50_ms"] / d["p50_ms"] - 1,
                              "overhead_p50_ms": g["p50_ms"] - d["p50_ms"],
                              "own_p50_ms": own, "own_share_p50": own / d["p50_ms"]}
        served = stack.gateway.served
        assert stack.recorder is not None
        server.call(stack.recorder.flush())
        recorded = stack.recorder.recorded
        sample = server.call(_last_served(server.bus))
        recording = server.call(_recording(server.bus, sample, setup.records))
        kafka = server.kafka
    overhead8, own8 = levels["8"]["overhead_p50"], levels["8"]["own_share_p50"]
    result: dict[str, Any] = {
        "levels": levels,
        "recording": {**recording, "served": served, "recorded": recorded, "bus": "kafka" if kafka else "memory"},
        "targets": {"gateway_overhead_p50_at_8<=10%": overhead8 <= 0.10,
                    "gateway_own_time_at_8<=10%_of_p50": own8 <= 0.10},
        "meta": {**meta(), "model": setup.model, "max_tokens": setup.max_tokens, "rounds": setup.rounds, "quick": quick,
                 "bootstrap": bootstrap if kafka else None},
    }
    rows = [[f"c={c} {path}", f["requests"], f["requests_per_s"], f["p50_ms"], f["p99_ms"],
             f"{levels[c]['overhead_p50']:+.1%}" if path == "gateway" else "",
             f"{levels[c]['own_p50_ms']:.1f} ({levels[c]['own_share_p50']:.1%})" if path == "gateway" else ""]
            for c in levels for path, f in (("direct", levels[c]["direct"]), ("gateway", levels[c]["gateway"]))]
    print_table(f"rlbus bench serve — {setup.model}, {setup.max_tokens} tokens, openai client vs engine",
                ["run", "requests", "req/s", "p50 ms", "p99 ms", "overhead p50", "own ms (of p50)"], rows)
    print_table("served → recorded (rl.served.v1 on " + ("Kafka" if kafka else "the in-memory bus") + ")",
                ["what", "value"],
                [["served / recorded", f"{served} / {recorded}"],
                 ["recorder records/s (batched)", recording["records_per_s"]],
                 ["one-at-a-time records/s (baseline)", recording["sequential_records_per_s"]],
                 ["record bytes", recording["record_bytes"]]])
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False, bootstrap: Bootstrap = "127.0.0.1:9092") -> None:
    """The OpenAI-compatible gateway under load: latency, throughput and what recording costs."""
    run(quick=quick, json_path=json_path, bootstrap=bootstrap)
