"""``swe``: a coding agent in a repository — shell and editor tools, hidden tests as the reward.

A prompt names one task of a corpus (``env_config.task``; the corpus is ``env_config.corpus``, default
the shipped one at ``rlbus/data/swe_tasks/``). The world is the task's repository in a sandbox
(`rlbus.envs.swe.world`), the tools are `rlbus.envs.swe.tools`, and the episode's result is the
repository's final diff against the template, carried in the rollout's metadata as ``swe.patch`` (a
rollout too large for Kafka goes through the claim check like any other). The reward worker grades it
from the rollout alone (`rlbus.envs.swe.grading.grade`): 1 only when every FAIL_TO_PASS and PASS_TO_PASS test
passes, with the fractions as components and the failing ids in the metadata. Defaults suit long
sessions: 30 turns, self-summarisation on, 8 K-token contexts.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path

import msgspec

from rlbus.envs.base import HarnessConfig, Task, World, config_data, register_env
from rlbus.envs.chat import format_tool_call
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import make_reward
from rlbus.envs.swe.expert import expert_calls
from rlbus.envs.swe.grading.grade import grade
from rlbus.envs.swe.patch import tree_diff
from rlbus.envs.swe.task import RepoTask, load_tasks
from rlbus.envs.swe.tools import repo_tools
from rlbus.envs.swe.world import open_world, template
from rlbus.errors import ConfigError
from rlbus.schemas import Prompt, Reward

SHIPPED_CORPUS = Path(__file__).resolve().parents[2] / "data" / "swe_tasks"
MAX_PATCH_BYTES = 4 << 20
SYSTEM = (
    "You are a software engineer working in a Python repository (your working directory, /sandbox/repo)."
    " Read the code, reproduce the problem, edit the files to fix it, run the tests, then call `submit`."
    " There is no network. Hidden tests decide whether the fix is right; changes to tests or test"
    " configuration are ignored."
)


class SweConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which corpus and task, and the harness budgets of a coding session."""

    max_turns: int = 30
    max_new_tokens: int = 512
    context_tokens: int = 8192
    max_total_tokens: int = 32768
    summarize: bool = True
    max_segments: int = 8
    summary_max_tokens: int = 512
    max_observation_tokens: int = 1024
    tool_timeout_s: float = 120.0
    corpus: list[str] = msgspec.field(default_factory=list)
    """Corpus directories, task directories or SWE-bench ``.jsonl`` files; empty: the shipped corpus."""
    task: str = ""
    """The task of this prompt (set by ``generate``)."""
    tasks: list[str] = msgspec.field(default_factory=list)
    """Generation: task ids to draw from (empty: every task of the corpus)."""
    command_timeout_s: float = 60.0
    """Wall-clock limit of one ``bash`` / ``search`` call."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.command_timeout_s <= 0:
            raise ValueError("command_timeout_s must be > 0")


@lru_cache(maxsize=16)
def catalogue(corpus: tuple[str, ...]) -> dict[str, RepoTask]:
    """The tasks of a corpus by id (loaded once per process)."""
    paths = list(corpus)
    if not paths:
        if not SHIPPED_CORPUS.is_dir():
            raise ConfigError("env_config.corpus", f"no corpus given and the shipped one ({SHIPPED_CORPUS}) is absent")
        paths = [str(SHIPPED_CORPUS)]
    return {t.task_id: t for t in load_tasks(paths)}


class SweEnv(Task[SweConfig]):
    config_type = SweConfig

    def task(self) -> RepoTask:
        tasks = catalogue(tuple(self.config.corpus))
        if self.config.task not in tasks:
            raise ConfigError("env_config.task", f"{self.config.task!r} is not a task of the corpus")
        return tasks[self.config.task]

    @asynccontextmanager
    async def world(self, prompt: Prompt) -> AsyncIterator[World]:
        task = self.task()
        async with open_world(task, command_timeout_s=self.config.command_timeout_s) as world:

            async def result() -> dict[str, str]:
                diff = await asyncio.to_thread(tree_diff, world.base, world.repo)
                patch = diff.patch
                out = {"swe.task": task.task_id, "swe.reset_s": f"{world.reset_s:.4f}"}
                if len(patch.encode()) > MAX_PATCH_BYTES:
                    out["swe.patch_too_large"] = str(len(patch.encode()))
                    patch = ""
                out["swe.patch"] = patch
                if diff.notes:
                    out["swe.notes"] = "; ".join(diff.notes)[:2000]
                return out

            yield World(tools=repo_tools(world, command_timeout_s=self.config.command_timeout_s), result=result)

    def instructions(self, world: World, *, native_tools: bool = False) -> str | None:
        if not self.config.instructions:
            return None
        if native_tools:
            return SYSTEM
        lines = [SYSTEM, 'Call a tool with <tool name="NAME">{JSON arguments}</tool>. Tools:']
        lines += [f"- {t.name} {json.dumps(t.parameters)}: {t.description}" for t in world.tools.values()]
        return "\n".join(lines)

    def generate(self, seed: int, n: int) -> list[Prompt]:
        tasks = catalogue(tuple(self.config.corpus))
        ids = sorted(self.config.tasks or tasks)
        unknown = [i for i in ids if i not in tasks]
        if unknown:
            raise ConfigError("env_config.tasks", f"{unknown[0]!r} is not a task of the corpus")
        rng = random.Random(seed)
        prompts = []
        for i in range(n):
            task = tasks[rng.choice(ids)]
            # Both turn budgets are upper bounds (the operator's harness config, the task's [limits]): the
            # episode gets the smaller, so a run configured for short episodes is never lengthened by a task.
            turns = min(self.config.max_turns, task.limits.max_turns)
            config = msgspec.structs.replace(self.config, task=task.task_id, max_turns=turns)
            prompts.append(Prompt(
                prompt_id=f"swe-{seed}-{i}", env="swe", text=prompt_text(task), env_config=config_data(config),
                metadata={"task": task.task_id},
            ))  # fmt: skip
        return prompts

    def reference_turns(self, prompt: Prompt) -> list[str]:
        """The expert's calls in the tagged format (``<tool name=…>{json}</tool>``), as the built-in tasks
        give theirs; chat-template models warm-start from `rlbus env trajectories` rows instead. Blocks
        while the template is built (first use), in a thread of its own so it works inside a running loop."""
        task = self.task()
        with ThreadPoolExecutor(max_workers=1) as pool:
            base = pool.submit(asyncio.run, template(task)).result()
        return [format_tool_call(name, json.dumps(args)) for name, args in expert_calls(task, base)]

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        task = self.task()
        if "swe.patch_too_large" in episode.metadata:
            reason = f"the diff is {episode.metadata['swe.patch_too_large']} bytes, over {MAX_PATCH_BYTES}"
            return make_reward(episode, prompt, source="tests", value=0.0, reason=reason,
                               components={"fail_to_pass": 0.0, "pass_to_pass": 0.0})  # fmt: skip
        verdict = await grade(task, episode.metadata.get("swe.patch", ""))
        return make_reward(
            episode, prompt, source="tests", value=verdict.value, reason=verdict.reason,
            components=verdict.components(), metadata={"task": task.task_id, **verdict.metadata()},
        )  # fmt: skip


def prompt_text(task: RepoTask) -> str:
    return task.instruction.strip() + "\n\nFix this in the repository, then call `submit`."


register_env("swe", SweEnv)
