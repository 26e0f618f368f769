"""Episodes in repository worlds: real tools in the sandbox, the final diff in the rollout, the reward
worker grading it; isolation (processes die, symlinks refused); expert trajectories for SFT."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.consumers.reward import RewardWorker
from rlbus.envs.agent import run_episode
from rlbus.envs.base import make_env
from rlbus.envs.chat import ChatFormat, format_tool_call
from rlbus.envs.episode import episode_to_rollout
from rlbus.envs.scripted import ScriptedEngine
from rlbus.envs.swe.task import Limits, RepoTask
from rlbus.envs.swe.tools import repo_tools
from rlbus.envs.swe.trajectories import ObservationCut, write_trajectories
from rlbus.envs.swe.world import open_world
from rlbus.errors import ToolError
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.training.sft import load_examples
from tests.unit.envs.swe.conftest import CORPUS

CHAT = ChatFormat.for_byte_tokenizer(ByteTokenizer())


def _env(**config: object):  # type: ignore[no-untyped-def]
    return make_env("swe", {"corpus": [str(CORPUS)], **config})


async def test_reference_episode_is_graded_one_by_the_reward_worker() -> None:
    env = _env()
    [prompt] = [p for p in env.generate(0, 6) if p.env_config["task"] == "calc-add"][:1]
    task_env = _env(**{k: v for k, v in prompt.env_config.items() if k in ("task", "max_turns")})
    turns = await asyncio.to_thread(task_env.reference_turns, prompt)
    engine = ScriptedEngine(turns, tokenizer=CHAT.tokenizer)
    episode = await run_episode(task_env, prompt, engine=engine, chat=CHAT)
    assert episode.finish_reason == "stop" and episode.answer == "submitted"
    assert episode.stats["tool_errors"] == 0 and "+    return a + b" in episode.metadata["swe.patch"]
    rollout = episode_to_rollout(episode, prompt=prompt, group_index=0)
    [reward] = await RewardWorker(bus=MemoryBus()).score(rollout)
    assert reward.value == 1.0 and reward.source == "tests" and reward.components["fail_to_pass"] == 1.0
    # the unchanged repository (a model that only submits) scores 0, with the failing test named
    idle = await run_episode(task_env, prompt, engine=ScriptedEngine([format_tool_call("submit", "{}")],
                             tokenizer=CHAT.tokenizer), chat=CHAT)  # fmt: skip
    [zero] = await RewardWorker(bus=MemoryBus()).score(episode_to_rollout(idle, prompt=prompt, group_index=1))
    assert zero.value == 0.0 and "test_add" in zero.metadata["failing"]


async def test_tools_work_and_bad_calls_are_observations(corpus_tasks: dict[str, RepoTask]) -> None:
    async with open_world(corpus_tasks["calc-add"], command_timeout_s=5) as world:
        tools = repo_tools(world, command_timeout_s=5)
        assert "calc/__init__.py" in await tools["view"].run('{"path": "."}')
        view = await tools["view"].run('{"path": "calc/__init__.py", "view_range": [4, 5]}')
        assert view.splitlines() == ["     4\tdef add(a, b):", "     5\t    return a - b"]
        await tools["str_replace"].run(json.dumps({"path": "calc/__init__.py", "old_str": "a - b\n\n\ndef sub",
                                                   "new_str": "a + b\n\n\ndef sub"}))  # fmt: skip
        await tools["insert"].run(json.dumps({"path": "calc/__init__.py", "insert_line": 0, "new_str": "# hi"}))
        await tools["create"].run(json.dumps({"path": "calc/new/mod.py", "file_text": "X = 1\n"}))
        assert "calc/new/mod.py:1:X = 1" in await tools["search"].run('{"pattern": "^X = "}')
        out = await tools["bash"].run("python -c 'import calc; print(calc.add(2, 3))'")
        assert out == "5\n[exit code 0]"
        assert "1 passed" in await tools["bash"].run('{"command": "python -m pytest -q -p no:cacheprovider tests"}')
        assert (await tools["bash"].run("exit 3")).endswith("[exit code 3]")
        assert "timed out" in await tools["bash"].run('{"command": "sleep 30", "timeout": 1}')
        for tool, argument, problem in [
            ("view", '{"path": "../../etc/passwd"}', "inside the repository"),
            ("view", '{"path": "nope.py"}', "no such file"),
            ("str_replace", '{"path": "calc/__init__.py", "old_str": "zzz", "new_str": ""}', "0 times"),
            ("insert", '{"path": "calc/__init__.py", "insert_line": 999, "new_str": "x"}', "insert_line"),
            ("bash", '{"cmd": "ls"}', "missing argument 'command'"),
            ("bash", '{"command": "ls", "timeout": "soon"}', "timeout"),
        ]:
            try:
                await tools[tool].run(argument)
            except Exception as exc:  # ToolError: the agent loop turns it into an observation
                assert problem in str(exc), (tool, str(exc))
            else:
                raise AssertionError(f"{tool} {argument} did not fail")


async def test_planted_symlinks_are_not_followed(corpus_tasks: dict[str, RepoTask]) -> None:
    async with open_world(corpus_tasks["calc-add"], command_timeout_s=5) as world:
        tools = repo_tools(world, command_timeout_s=5)
        await tools["bash"].run("ln -s /etc/hostname host && ln -s / root")
        for call in ('{"path": "host"}', '{"path": "root/etc/hostname"}'):
            try:
                out = await tools["view"].run(call)
            except Exception as exc:
                assert "no such file" in str(exc)
            else:
                raise AssertionError(f"followed a symlink: {out[:80]}")


async def test_background_processes_die_with_the_call(corpus_tasks: dict[str, RepoTask]) -> None:
    marker = "4242.125"
    async with open_world(corpus_tasks["calc-add"], command_timeout_s=5) as world:
        tools = repo_tools(world, command_timeout_s=5)
        out = await tools["bash"].run(f"(sleep {marker} &) ; nohup sleep {marker} >/dev/null 2>&1 & echo started")
        assert "started" in out
        assert not _sleepers(marker), "a background process outlived its tool call"
        assert "[exit code 1]" in await tools["bash"].run("pgrep -x sleep")  # not in the next call either
        world_dir = world.box.path
    assert not world_dir.exists() and not _sleepers(marker)


def _sleepers(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"sleep {marker}" in cmd and state != "Z":
            found.append(int(pid))
    return found


async def test_expert_trajectories_are_sft_rows(corpus_tasks: dict[str, RepoTask], tools_tokenizer: object) -> None:
    out = io.StringIO()
    written = await write_trajectories([corpus_tasks["calc-add"]], out)
    assert written == 1
    row = json.loads(out.getvalue())
    names = [m["tool_calls"][0]["function"]["name"] for m in row["messages"] if m["role"] == "assistant"]
    assert names[0] == "view" and "str_replace" in names and names[-1] == "submit"
    assert {t["function"]["name"] for t in row["tools"]} >= {"bash", "view", "str_replace", "submit"}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"swe-traj-{os.getpid()}.jsonl"
    path.write_text(out.getvalue())
    try:
        chat = ChatFormat.for_hf_tokenizer(tools_tokenizer)
        [example] = load_examples(path, chat)
    finally:
        path.unlink()
    ids, trained = example.token_ids, example.trained
    text = chat.tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t])
    assert '"name": "str_replace"' in text and "return a + b" in text  # the calls are trained
    assert "def mul" not in text  # tool output (the file view) is context, not trained


async def test_trajectories_cut_observations_as_the_agent_loop_does(corpus_tasks: dict[str, RepoTask]) -> None:
    whole, cut_out = io.StringIO(), io.StringIO()
    await write_trajectories([corpus_tasks["calc-add"]], whole)
    cut = ObservationCut(CHAT, 12)
    assert await write_trajectories([corpus_tasks["calc-add"]], cut_out, cut=cut) == 1  # graded on the full replay
    rows = [json.loads(f.getvalue()) for f in (whole, cut_out)]
    tool_outputs = [[m["content"] for m in r["messages"] if m["role"] == "tool"] for r in rows]
    assert any(len(CHAT.encode(t)) > 12 for t in tool_outputs[0])
    # each output is the agent loop's cut: the first 12 tokens, decoded (the byte tokenizer: 12 bytes)
    assert tool_outputs[1] == [CHAT.tokenizer.decode(CHAT.encode(t)[:12]) for t in tool_outputs[0]]
    calls = [[m.get("tool_calls") for m in r["messages"] if m["role"] == "assistant"] for r in rows]
    assert calls[0] == calls[1]  # only what the model reads changes


def test_cli_observation_default_is_the_envs() -> None:
    import inspect

    from rlbus.cli.env import env_trajectories
    from rlbus.envs.swe.env import SweConfig

    default = inspect.signature(env_trajectories).parameters["max_observation_tokens"].default
    assert default == SweConfig().max_observation_tokens


async def test_long_sessions_summarise_with_this_env() -> None:
    env = _env(task="calc-add", context_tokens=900, max_new_tokens=48, summary_max_tokens=32,
               max_observation_tokens=120, max_turns=12, instructions=False)  # fmt: skip
    [prompt] = _env().generate(1, 1)
    turns = [format_tool_call("view", '{"path": "calc/__init__.py"}')] * 14 + [format_tool_call("submit", "{}")]
    engine = ScriptedEngine(turns, tokenizer=CHAT.tokenizer)
    episode = await run_episode(env, prompt, engine=engine, chat=CHAT)
    assert episode.stats["segments"] >= 2  # the context filled up and the episode went on from a summary
    assert episode.metadata["swe.patch"] == ""  # viewing changes nothing


async def test_tools_refuse_after_the_session_deadline(corpus_tasks: dict[str, RepoTask]) -> None:
    task = dataclasses.replace(corpus_tasks["calc-add"], limits=Limits(agent_timeout_s=1.0))
    async with open_world(task, command_timeout_s=5) as world:
        tools = repo_tools(world, command_timeout_s=5)
        assert "timed out after" in await tools["bash"].run("sleep 3")  # capped at the session's time left
        with pytest.raises(ToolError, match="are up"):
            await tools["view"].run('{"path": "."}')
        assert await tools["submit"].run("{}") == "submitted"


async def test_edits_through_planted_symlinks_are_refused(corpus_tasks: dict[str, RepoTask]) -> None:
    async with open_world(corpus_tasks["calc-add"], command_timeout_s=5) as world:
        tools = repo_tools(world, command_timeout_s=5)
        outside = world.box.path / "outside"
        await tools["bash"].run("mkdir ../outside && ln -s /sandbox/outside calc/out && echo x > calc/out/f.py")
        for tool, args in [
            ("create", {"path": "calc/out/new.py", "file_text": "x"}),
            ("str_replace", {"path": "calc/out/f.py", "old_str": "x", "new_str": "y"}),
            ("insert", {"path": "calc/out/f.py", "insert_line": 0, "new_str": "y"}),
        ]:
            with pytest.raises(ToolError):
                await tools[tool].run(json.dumps(args))
        assert sorted(p.name for p in outside.iterdir()) == ["f.py"] and (outside / "f.py").read_text() == "x\n"


def test_turn_budget_is_the_smaller_of_the_harness_and_the_task() -> None:
    # calc-add's task.toml says max_turns = 8; the harness config may only lower it, never raise it
    def turns(**config: object) -> int:
        [prompt] = [p for p in _env(**config).generate(0, 12) if p.env_config["task"] == "calc-add"][:1]
        return int(prompt.env_config["max_turns"])

    assert turns(max_turns=5) == 5
    assert turns(max_turns=30) == 8
    assert _env(max_turns=3).limits().max_turns == 3


async def test_the_grader_is_not_in_the_episodes_world(corpus_tasks: dict[str, RepoTask]) -> None:
    """The launcher that grades the patch is mounted in grading sandboxes only: an agent with ``bash`` finds
    no copy of it (the runtime and the whole filesystem it sees), while its own ``python -m pytest`` runs;
    the grading sandbox has it."""
    from rlbus.envs.swe.runtime import GRADER_INNER, INNER
    from rlbus.envs.swe.world import task_sandbox

    async with open_world(corpus_tasks["calc-add"], command_timeout_s=10) as world:
        bash = repo_tools(world, command_timeout_s=10)["bash"]
        assert "[exit code 0]" in await bash.run(f"test -d {INNER}/site && test -x {INNER}/bin/python")
        out = await bash.run(f"ls {GRADER_INNER} {INNER}/grader; find / -name 'grader_*' 2>/dev/null | head")
        assert "grader_" not in out and "No such file" in out, out
        assert "1 passed" in await bash.run('{"command": "python -m pytest -q -p no:cacheprovider tests"}')
    async with task_sandbox(corpus_tasks["calc-add"], grading=True) as box:
        listed = await box.run(["/bin/ls", GRADER_INNER])
        assert listed.ok and "grader_main.py" in listed.stdout, listed
