"""``python_fn``: write a Python function; hidden unit tests decide the reward, run in the sandbox.

The model answers with the function's source (``<answer>def add(a, b): …</answer>``; Markdown code fences
are stripped). During the episode it may run programs with the ``python`` tool, in the episode's own
sandbox directory (`rlbus.sandbox`).

Scoring runs the candidate in a fresh sandbox with a small harness that calls the function on each test's
*inputs* and writes the return values (JSON) to a file; the worker compares them with the expected values
outside the sandbox. The expected values never enter the sandbox because the candidate shares a process
with anything in there and could read or patch in-process assertions; this way it can only report outputs,
which is the job it was given. Values compare as canonical JSON, so ``1`` is not ``True``.

Reward: ``scoring = "all"`` (default) gives 1.0 only when every hidden test passes, ``"fraction"`` the
fraction passed. A candidate that crashes, loops (sandbox timeout), forks without end, exhausts memory, or
touches the network or files outside the sandbox scores 0 with the sandbox's reason. If the sandbox itself
cannot be built, `score` raises `SandboxError`: that is the worker's failure, not the model's, and must
not be recorded as a zero.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import msgspec

from rlbus.envs.base import HarnessConfig, Task, Tool, World, config_data, register_env
from rlbus.envs.chat import format_answer
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import make_reward
from rlbus.envs.tasks.pybank import PROBLEMS, Problem
from rlbus.sandbox import Sandbox, SandboxLimits, SandboxResult
from rlbus.schemas import Prompt, Reward

_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_+-]*\s*\n(.*?)\n?\s*```\s*$", re.DOTALL)

HARNESS = """\
import json
spec = json.load(open("inputs.json"))
namespace = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    fn = namespace[spec["function"]]
except BaseException as exc:
    results = {"error": (type(exc).__name__ + ": " + str(exc))[:300]}
else:
    results = []
    for args in spec["inputs"]:
        try:
            value = fn(*args)
            json.dumps(value)
            results.append({"ok": True, "value": value})
        except BaseException as exc:
            results.append({"ok": False, "error": (type(exc).__name__ + ": " + str(exc))[:300]})
with open("results.json", "w") as f:
    json.dump(results, f)
"""


class HiddenTest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    args: list[Any]
    """Positional arguments of the call."""
    expected: Any
    """The JSON value the call must return."""


class PythonFnConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The function and its hidden tests (per prompt), sandbox limits, and how ``generate`` draws."""

    max_turns: int = 3
    max_new_tokens: int = 256
    context_tokens: int = 2048
    max_total_tokens: int = 4096
    tool_timeout_s: float = 15.0
    function: str = ""
    """Name of the function the answer must define."""
    tests: list[HiddenTest] = msgspec.field(default_factory=list)
    """Hidden tests; never shown to the model."""
    scoring: Literal["all", "fraction"] = "all"
    """``all``: 1.0 only if every test passes; ``fraction``: the fraction that pass."""
    timeout_s: float = 10.0
    """Wall-clock limit of one sandboxed run (tests or a ``python`` tool call)."""
    memory_mb: int = 256
    """Address-space limit per sandboxed process."""
    python_tool: bool = True
    """Offer the ``python`` tool, which runs a program in the episode's sandbox."""
    problems: list[str] = msgspec.field(default_factory=list)
    """Generation: names from the problem bank to draw from (empty: all)."""
    num_tests: int = 5
    """Generation: hidden tests per prompt."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = sorted(set(self.problems) - set(PROBLEMS))
        if unknown:
            raise ValueError(f"problems {unknown} are not in the bank ({', '.join(PROBLEMS)})")
        if self.timeout_s <= 0 or self.memory_mb < 64 or self.num_tests < 1:
            raise ValueError("timeout_s must be > 0, memory_mb ≥ 64, num_tests ≥ 1")


class PythonFnTask(Task[PythonFnConfig]):
    config_type = PythonFnConfig

    def sandbox_limits(self) -> SandboxLimits:
        cpu_s = int(self.config.timeout_s) + 1  # a backstop: the wall clock ends a busy loop first
        return SandboxLimits(wall_s=self.config.timeout_s, cpu_s=cpu_s, memory_mb=self.config.memory_mb)

    @asynccontextmanager
    async def world(self, prompt: Prompt) -> AsyncIterator[World]:
        if not self.config.python_tool:
            yield World()
            return
        async with Sandbox(limits=self.sandbox_limits()) as box:
            yield World(tools={"python": python_tool(box)})

    def generate(self, seed: int, n: int) -> list[Prompt]:
        rng = random.Random(seed)
        names = self.config.problems or sorted(PROBLEMS)
        return [self._prompt(rng, PROBLEMS[rng.choice(names)], f"python_fn-{seed}-{i}") for i in range(n)]

    def _prompt(self, rng: random.Random, problem: Problem, prompt_id: str) -> Prompt:
        inputs = [problem.make_args(rng) for _ in range(self.config.num_tests)]
        tests = [HiddenTest(args=a, expected=_canonical_value(problem.solution(*a))) for a in inputs]
        config = config_data(msgspec.structs.replace(self.config, function=problem.name, tests=tests))
        example = f"{_call(problem.name, tests[0].args)} == {tests[0].expected!r}"
        text = f"Write a Python function {problem.signature} that {problem.description}. Example: {example}."
        return Prompt(prompt_id=prompt_id, env="python_fn", text=text, reference=problem.source, env_config=config)

    def reference_turns(self, prompt: Prompt) -> list[str]:
        if prompt.reference is None:
            raise ValueError(f"prompt {prompt.prompt_id} has no reference solution")
        return [format_answer(prompt.reference)]

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        if not self.config.function or not self.config.tests:
            raise ValueError(f"prompt {prompt.prompt_id}: env_config needs `function` and `tests`")
        if episode.answer is None:
            reason = f"no answer (episode ended with {episode.finish_reason!r})"
            return self._reward(episode, prompt, 0, reason)
        run, outputs = await run_hidden_tests(
            extract_code(episode.answer), self.config.function, [t.args for t in self.config.tests],
            self.sandbox_limits(),
        )  # fmt: skip
        if isinstance(outputs, str):
            return self._reward(episode, prompt, 0, outputs, run)
        passed, reason = self._compare(outputs)
        return self._reward(episode, prompt, passed, reason, run)

    def _compare(self, outputs: list[Any]) -> tuple[int, str]:
        passed, first_failure = 0, ""
        for test, out in zip(self.config.tests, outputs, strict=True):
            if out.get("ok") and _canonical(out.get("value")) == _canonical(test.expected):
                passed += 1
            elif not first_failure:
                got = f"returned {out.get('value')!r}" if out.get("ok") else f"raised {out.get('error')}"
                first_failure = f"; first failure: {_call(self.config.function, test.args)} {got}"
                first_failure += f", expected {test.expected!r}"
        return passed, f"{passed}/{len(self.config.tests)} hidden tests passed{first_failure}"

    def _reward(
        self, episode: Episode, prompt: Prompt, passed: int, reason: str, run: SandboxResult | None = None
    ) -> Reward:
        total = len(self.config.tests)
        fraction = passed / total
        value = fraction if self.config.scoring == "fraction" else float(passed == total)
        metadata = {} if run is None else {"sandbox_status": run.status, "sandbox_wall_s": f"{run.wall_s:.3f}"}
        components = {"passed": float(passed), "total": float(total), "pass_fraction": fraction}
        return make_reward(episode, prompt, source="sandbox", value=value, reason=reason,
                           components=components, metadata=metadata)  # fmt: skip


async def run_hidden_tests(
    code: str, function: str, inputs: list[list[Any]], limits: SandboxLimits
) -> tuple[SandboxResult, list[dict[str, Any]] | str]:
    """Call ``function`` from ``code`` on each input in a fresh sandbox.

    Returns the run and either one ``{"ok", "value" | "error"}`` record per input, or why there are none.
    """
    async with Sandbox(limits=limits) as box:
        box.write_file("solution.py", code)
        box.write_file("inputs.json", json.dumps({"function": function, "inputs": inputs}))
        box.write_file("harness.py", HARNESS)
        run = await box.run_python("harness.py")
        raw = box.read_file("results.json")
    if run.status != "ok":
        return run, f"sandbox {run.status}: {run.reason}"
    if raw is None:
        return run, "the solution ended the process before the tests finished"
    try:
        results = json.loads(raw)
    except ValueError:
        return run, "the results file is not JSON"
    if isinstance(results, dict):
        return run, f"solution does not load: {results.get('error')}"
    if not isinstance(results, list) or len(results) != len(inputs) or not all(isinstance(r, dict) for r in results):
        return run, "the results file does not have one record per test"
    return run, results


def python_tool(box: Sandbox) -> Tool:
    """``python``: run the input as a program in the episode's sandbox; the output is the observation."""

    async def run(code: str) -> str:
        box.write_file("main.py", extract_code(code))
        result = await box.run_python("main.py")
        parts = [f"[{result.status}: {result.reason}]", result.stdout, result.stderr]
        return "\n".join(p.rstrip() for p in parts if p.strip())

    return Tool("python", "runs a Python program and returns its output", run)


def extract_code(answer: str) -> str:
    """The answer's code, without a surrounding Markdown fence."""
    fenced = _FENCE.match(answer)
    return (fenced.group(1) if fenced else answer).strip("\n") + "\n"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _canonical_value(value: Any) -> Any:
    result: Any = json.loads(_canonical(value))
    return result


def _call(name: str, args: list[Any]) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


register_env("python_fn", PythonFnTask)
