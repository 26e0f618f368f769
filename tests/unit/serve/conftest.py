"""A running gateway for the serve tests: the real engine stack over a tiny random HF Llama (ChatML, so
tools render natively) on the in-memory bus, answering on a free port; the official ``openai`` client
talks to it over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import ServeStack, serve_stack

TOKENS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcd"}


@dataclass
class Running:
    stack: ServeStack
    bus: MemoryBus
    url: str

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@pytest.fixture
async def gateway(tiny_hf_dir: Path) -> AsyncIterator[Running]:
    from rlbus.models.hf_source import HFSource

    async with running(HFSource(tiny_hf_dir), "tiny") as served:
        yield served


@pytest.fixture
async def tagged_gateway() -> AsyncIterator[Running]:
    """The in-house byte-level model (``rlbus serve --model tiny``, with room for a tools prompt): a tagged
    chat format."""
    import dataclasses

    from rlbus.models.config import PolicyConfig
    from rlbus.models.policy_source import PolicySource

    shape = dataclasses.replace(PolicyConfig.tiny(), max_seq=2048)
    async with running(PolicySource(shape), "tiny-byte") as served:
        yield served


@asynccontextmanager
async def running(source: Any, name: str) -> AsyncIterator[Running]:
    async with MemoryBus(topic_specs()) as bus:
        stack = serve_stack(bus=bus, source=source, tenants=Tenants(TOKENS),
                            model_name=name, max_staleness=2, max_open_sessions=4, default_max_tokens=16)
        stop = asyncio.Event()
        task = asyncio.create_task(stack.gateway.run(stop, "127.0.0.1", 0))
        await asyncio.wait_for(stack.gateway.listening.wait(), 60)
        host, port = stack.gateway.address or ("", 0)
        try:
            yield Running(stack=stack, bus=bus, url=f"http://{host}:{port}")
        finally:
            stop.set()
            await task
