"""Expert trajectories for warm start: each task's reference solution replayed through the real tools.

The scripted expert's calls (`rlbus.envs.swe.expert`) run against a live world, and each becomes an
OpenAI-format assistant message with ``tool_calls`` followed by a ``tool`` message with the real output.
A row is ``{"messages": [system, user, assistant, tool, …, assistant(submit)], "tools": [schemas],
"task": id, "reward": r}`` — the chat form `rlbus pretrain` reads (`rlbus.training.sft.load_examples`
renders it with the model's chat template; the tool schemas go into the system message as the template
writes them, and only assistant turns are trained). A replay whose final diff does not score 1 is
reported and left out, so the file only teaches fixes that pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlbus.envs.chat import ChatFormat
from rlbus.envs.swe.env import SYSTEM, prompt_text
from rlbus.envs.swe.expert import expert_calls
from rlbus.envs.swe.grading.grade import grade
from rlbus.envs.swe.patch import tree_diff
from rlbus.envs.swe.task import RepoTask
from rlbus.envs.swe.tools import repo_tools
from rlbus.envs.swe.world import open_world
from rlbus.envs.tool_calls import tool_schema
from rlbus.errors import ToolError


@dataclass(frozen=True)
class ObservationCut:
    """The agent loop's observation limit: the first ``max_tokens`` tokens in ``chat``'s tokenizer."""

    chat: ChatFormat
    max_tokens: int

    def __call__(self, text: str) -> str:
        ids = self.chat.encode(text)
        return text if len(ids) <= self.max_tokens else self.chat.tokenizer.decode(ids[: self.max_tokens])


async def replay(task: RepoTask, cut: ObservationCut | None = None) -> tuple[dict[str, Any], float, str]:
    """(row, reward of the replayed diff, grading reason); tool outputs pass through ``cut`` if given."""
    async with open_world(task) as world:
        tools = repo_tools(world)
        calls = expert_calls(task, world.base)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": prompt_text(task)},
        ]
        for n, (name, args) in enumerate(calls):
            call_id = f"call_{n}"
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            ]})  # fmt: skip
            try:
                output = await tools[name].run(json.dumps(args))
            except ToolError as exc:
                output = f"error: {exc}"
            if name != "submit":
                content = output if cut is None else cut(output)
                messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        patch = tree_diff(world.base, world.repo).patch
    verdict = await grade(task, patch)
    schemas = [tool_schema(t.name, t.description, t.parameters) for t in tools.values()]
    return (
        {"messages": messages, "tools": schemas, "task": task.task_id, "reward": verdict.value},
        verdict.value,
        verdict.reason,
    )


async def write_trajectories(
    tasks: list[RepoTask],
    out: Any,
    on_task: Callable[[str, float, str], None] | None = None,
    *,
    cut: ObservationCut | None = None,
) -> int:
    """Replay every task, write the rows that score 1 to the open text file ``out``; returns rows written.
    The grade is of the full replay (the cut changes only what the row shows the model)."""
    written = 0
    for task in tasks:
        row, reward, reason = await replay(task, cut)
        if on_task is not None:
            on_task(task.task_id, reward, reason)
        if reward == 1.0:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += 1
    return written
