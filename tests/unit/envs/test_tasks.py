"""Built-in tasks: seeded generation, reference solutions that score 1.0, wrong answers that score 0."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from rlbus.envs.agent import reference_episode, run_episode
from rlbus.envs.base import Task, env_for, make_env
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import Episode
from rlbus.envs.scripted import ScriptedEngine
from rlbus.envs.tasks import generate_prompts
from rlbus.envs.tasks.pybank import PROBLEMS
from rlbus.envs.tasks.python_fn import extract_code, run_hidden_tests
from rlbus.sandbox import SandboxLimits
from rlbus.schemas import Prompt

CHAT = ChatFormat.for_byte_tokenizer()
CHEAP = [("arith", {"ops": ["+", "-", "*"]}), ("strings", {}), ("kv", {"hops": 1}), ("kv", {"hops": 3, "keys": 5})]


def test_the_built_in_tasks_are_registered_when_only_envs_base_is_imported() -> None:
    script = ("import sys; from rlbus.envs.base import make_env, registered_envs; make_env('arith'); "
              "print(registered_envs(), 'reasoning_gym' in sys.modules, 'verifiers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    names = ["answer", "arith", "kv", "python_fn", "reasoning_gym", "strings", "swe", "verifiers"]
    # the adapters register without importing their libraries
    assert done.stdout.strip() == f"{names} False False"


def answered(prompt: Prompt, answer: str | None, finish: str = "stop") -> Episode:
    return Episode(episode_id=f"ep-{prompt.prompt_id}", token_ids=[], loss_mask=[], logprobs=[], token_versions=[],
                   turns=[], finish_reason=finish, answer=answer)  # fmt: skip


@pytest.mark.parametrize(("env", "config"), [*CHEAP, ("python_fn", {})])
def test_generation_is_seeded(env: str, config: dict[str, Any]) -> None:
    first = generate_prompts(env, seed=11, n=6, config=config)
    assert first == generate_prompts(env, seed=11, n=6, config=config)
    assert [p.text for p in first] != [p.text for p in generate_prompts(env, seed=12, n=6, config=config)]
    assert len({p.prompt_id for p in first}) == 6
    assert all(p.env == env and p.reference for p in first)
    for p in first:  # every prompt's env_config builds its environment
        env_for(p)


@pytest.mark.parametrize(("env", "config"), CHEAP)
async def test_reference_solutions_score_one_and_wrong_answers_zero(env: str, config: dict[str, Any]) -> None:
    for prompt in generate_prompts(env, seed=3, n=8, config=config):
        task = env_for(prompt)
        assert isinstance(task, Task)
        episode = await reference_episode(task, prompt, chat=CHAT)
        reward = await task.score(episode, prompt)
        assert (episode.finish_reason, reward.value, reward.source) == ("stop", 1.0, "verifier"), reward.reason
        assert reward.rollout_id == episode.episode_id and reward.reward_id == f"{episode.episode_id}:verifier"
        assert (await task.score(answered(prompt, f"{prompt.reference}0"), prompt)).value == 0.0
        none = await task.score(answered(prompt, None, "max_turns"), prompt)
        assert none.value == 0.0 and "max_turns" in none.reason


def test_arith_and_strings_stay_tiny() -> None:
    for p in generate_prompts("arith", seed=0, n=200):
        assert len(p.text) <= 6 and len(p.reference or "") <= 3
        a, b = p.text[:-1].split("+")
        assert int(a) + int(b) == int(p.reference or "")
    ops = {p.text.split(":")[0] for p in generate_prompts("strings", seed=0, n=100)}
    assert ops == {"reverse", "upper", "sort", "dedupe"}
    [p] = generate_prompts("strings", seed=1, n=1, config={"ops": ["reverse"]})
    assert p.reference == p.text.removeprefix("reverse: ")[::-1]


async def test_exact_match_is_case_sensitive_and_trims() -> None:
    prompt = Prompt(prompt_id="s", env="strings", text="upper: abc", reference="ABC")
    task = env_for(prompt)
    assert (await task.score(answered(prompt, " ABC\n"), prompt)).value == 1.0
    assert (await task.score(answered(prompt, "abc"), prompt)).value == 0.0


async def test_kv_needs_the_tools() -> None:
    [prompt] = generate_prompts("kv", seed=5, n=1, config={"hops": 2})
    table = prompt.env_config["table"]
    assert prompt.reference is not None and prompt.reference not in prompt.text
    assert prompt.reference in table.values()
    guess = ScriptedEngine(["<answer>123</answer>"], tokenizer=CHAT.tokenizer)
    episode = await run_episode(env_for(prompt), prompt, engine=guess, chat=CHAT)
    assert prompt.reference != "123" and (await env_for(prompt).score(episode, prompt)).value == 0.0
    lost = ScriptedEngine(['<tool name="get">zzz</tool>', '<tool name="keys"></tool>', "<answer>1</answer>"],
                          tokenizer=CHAT.tokenizer)  # fmt: skip
    episode = await run_episode(env_for(prompt), prompt, engine=lost, chat=CHAT)
    observations = [t.text for t in episode.turns if t.role == "tool"]
    assert observations == ["error: no key 'zzz'", ", ".join(sorted(table))]


def test_kv_config_is_checked() -> None:
    with pytest.raises(Exception, match="start"):
        make_env("kv", {"table": {"a": "1"}, "start": "b"})


async def test_every_python_problem_reference_passes_its_hidden_tests() -> None:
    for name in sorted(PROBLEMS):
        [prompt] = generate_prompts("python_fn", seed=2, n=1, config={"problems": [name], "num_tests": 4})
        task = env_for(prompt)
        reward = await task.score(answered(prompt, prompt.reference), prompt)
        assert (reward.value, reward.source) == (1.0, "sandbox"), f"{name}: {reward.reason}"
        assert reward.components == {"passed": 4.0, "total": 4.0, "pass_fraction": 1.0}


async def test_python_reference_episode_with_the_python_tool() -> None:
    [prompt] = generate_prompts("python_fn", seed=4, n=1, config={"problems": ["add"]})
    task = env_for(prompt)
    assert isinstance(task, Task)
    episode = await reference_episode(task, prompt, chat=CHAT)
    assert (await task.score(episode, prompt)).value == 1.0
    engine = ScriptedEngine(['<tool name="python">print(2 + 3)</tool>', f"<answer>{prompt.reference}</answer>"],
                            tokenizer=CHAT.tokenizer)  # fmt: skip
    episode = await run_episode(task, prompt, engine=engine, chat=CHAT)
    assert [t.text for t in episode.turns if t.role == "tool"] == ["[ok: exited normally]\n5"]
    assert (await task.score(episode, prompt)).value == 1.0


@pytest.mark.parametrize(
    ("code", "value", "reason"),
    [
        ("def add(a, b):\n    return a - b", 0.0, "first failure: add("),
        ("def add(a, b):\n    return a + b if a >= 0 else 0", 0.0, "4/5 hidden tests passed"),
        ("```python\ndef add(a, b):\n    return a + b\n```", 1.0, "5/5 hidden tests passed"),
        ("def add(a, b):\n    return float(a + b)", 0.0, "returned"),
        ("def ad(a, b):\n    return a + b", 0.0, "solution does not load: KeyError"),
        ("def add(a, b) return", 0.0, "solution does not load: SyntaxError"),
        ("import os\nos._exit(0)", 0.0, "ended the process"),
        ("while True:\n    pass", 0.0, "sandbox timeout"),
        ("import socket\nsocket.create_connection(('8.8.8.8', 53))", 0.0, "OSError"),
        ("def add(a, b):\n    return open('/etc/shadow').read()", 0.0, "raised FileNotFoundError"),
    ],
)
async def test_python_wrong_and_hostile_answers_score_zero(code: str, value: float, reason: str) -> None:
    prompt = _add_prompt({"timeout_s": 1.0})
    reward = await env_for(prompt).score(answered(prompt, code), prompt)
    assert reward.value == value and reason in reward.reason, reward.reason


async def test_python_fraction_scoring_and_strict_types() -> None:
    prompt = _add_prompt({"scoring": "fraction"})
    half = "def add(a, b):\n    return a + b if a >= 0 else -1"
    reward = await env_for(prompt).score(answered(prompt, half), prompt)
    assert 0.0 < reward.value < 1.0 and reward.value == reward.components["pass_fraction"]
    truthy = Prompt(prompt_id="pal", env="python_fn", text="t", env_config={
        "function": "is_palindrome", "tests": [{"args": ["aba"], "expected": True}]})  # fmt: skip
    ones = "def is_palindrome(s):\n    return 1 if s == s[::-1] else 0"
    assert (await env_for(truthy).score(answered(truthy, ones), truthy)).value == 0.0  # 1 is not True


async def test_expected_values_never_enter_the_sandbox() -> None:
    spy = "import os\ndef spy():\n    return {n: open(n).read() for n in sorted(os.listdir('.')) if os.path.isfile(n)}"
    run, outputs = await run_hidden_tests(spy, "spy", [[]], SandboxLimits(wall_s=5))
    assert run.ok and isinstance(outputs, list)
    files = outputs[0]["value"]
    assert set(files) == {"harness.py", "inputs.json", "solution.py"}
    assert "expected" not in json.dumps(files)


def test_extract_code() -> None:
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("x = 1") == "x = 1\n"


def _add_prompt(extra: dict[str, Any]) -> Prompt:
    tests = [{"args": [a, b], "expected": a + b} for a, b in [(1, 2), (-3, 4), (0, 0), (10, -20), (7, 7)]]
    config = {"function": "add", "tests": tests, **extra}
    return Prompt(prompt_id="add", env="python_fn", text="Write add(a, b).", env_config=config)
