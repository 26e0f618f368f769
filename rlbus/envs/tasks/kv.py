"""``kv``: a multi-turn tool task — follow a chain of keys through a hidden table to a number.

The world is a small key→value table the model never sees. The prompt names a start key; its value is
either another key or a number, and the answer is the number at the end of the chain (``hops`` lookups).
The numbers are random, so the task cannot be solved without calling the tools:

    get KEY     the value stored under KEY (an error observation for an unknown key)
    keys        every key of the table, comma-separated

A reference solution is ``hops`` ``get`` calls followed by the answer.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, nullcontext

import msgspec

from rlbus.envs.base import HarnessConfig, Task, Tool, World, config_data, register_env
from rlbus.envs.chat import format_answer, format_tool_call
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import exact_match
from rlbus.errors import ToolError
from rlbus.schemas import Prompt, Reward


class KVConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The hidden table and start key (per prompt), and how ``generate`` builds them."""

    max_turns: int = 6
    max_new_tokens: int = 32
    context_tokens: int = 512
    max_total_tokens: int = 1024
    table: dict[str, str] = msgspec.field(default_factory=dict)
    """The world: key → value (another key, or the number)."""
    start: str = ""
    """The key the chain starts from."""
    keys: int = 6
    """Generation: keys in the table (the chain plus distractors)."""
    hops: int = 1
    """Generation: lookups from the start key to the number."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.hops <= self.keys:
            raise ValueError("hops must be ≥ 1 and ≤ keys")
        if self.table and self.start not in self.table:
            raise ValueError(f"start {self.start!r} is not a key of table")


class KVTask(Task[KVConfig]):
    config_type = KVConfig

    def world(self, prompt: Prompt) -> AbstractAsyncContextManager[World]:
        return nullcontext(World(tools=table_tools(self.config.table)))

    def generate(self, seed: int, n: int) -> list[Prompt]:
        rng = random.Random(seed)
        return [self._prompt(rng, f"kv-{seed}-{i}") for i in range(n)]

    def _prompt(self, rng: random.Random, prompt_id: str) -> Prompt:
        names = _distinct_keys(rng, self.config.keys)
        chain, number = names[: self.config.hops], str(rng.randint(100, 999))
        table = {k: str(rng.randint(100, 999)) for k in names}
        table.update(zip(chain, [*chain[1:], number], strict=True))
        config = config_data(msgspec.structs.replace(self.config, table=table, start=chain[0]))
        text = f"Find the number at the end of the chain from key {chain[0]}."
        return Prompt(prompt_id=prompt_id, env="kv", text=text, reference=number, env_config=config)

    def reference_turns(self, prompt: Prompt) -> list[str]:
        turns, key = [], self.config.start
        for _ in range(len(self.config.table)):
            turns.append(format_tool_call("get", key))
            key = self.config.table[key]
            if key not in self.config.table:
                return [*turns, format_answer(key)]
        raise ValueError(f"prompt {prompt.prompt_id}: the chain from {self.config.start!r} never reaches a number")

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        return exact_match(episode, prompt)


def table_tools(table: Mapping[str, str]) -> dict[str, Tool]:
    async def get(key: str) -> str:
        if key not in table:
            raise ToolError(f"no key {key!r}")
        return table[key]

    async def keys(_: str) -> str:
        return ", ".join(sorted(table))

    return {
        "get": Tool("get", "get KEY returns the value stored under KEY", get),
        "keys": Tool("keys", "lists every key", keys),
    }


def _distinct_keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = "".join(rng.choices(string.ascii_lowercase, k=3))
        if key not in keys:
            keys.append(key)
    return keys


register_env("kv", KVTask)
