"""``rlbus bench swe``: the coding environment — corpus validity, cheater suite, world and tool speed, SmolLM2.

1. **Corpus**: `rlbus env check` on every task (the shipped corpus if present, plus the test fixtures):
   ``tasks_valid`` of ``tasks``. These are the false-positive check: every reference solution must score 1
   and every unchanged repository 0 (``false_positives`` lists the tasks that do not); ``grade_s`` gives the
   seconds of one grade by library (median of the reference's and the unchanged repository's), and
   ``grade_s_median`` over all.
2. **Cheater suite** (`rlbus.envs.swe.grading.cheats`) on one task of each library (one task in all when
   ``--quick``): each cheat must score 0 — ``cheats_tried`` / ``cheats_scored_zero``. Then the attacks on
   the grader (`rlbus.envs.swe.grading.cheats.ATTACKS` and the six classes of
   `rlbus.envs.swe.grading.attacks`), by kind:
   ``scored_zero`` of ``tried`` on the unfixed repository, and each again *on top of the reference
   solution*: ``detected`` (a tamper finding scores it 0), ``inert`` (it changed nothing: the fix rightly
   scores 1) or ``spoiled`` (no finding, but the attack broke the fix it rode on: 0).
3. **Reset**: per-episode copy of a template — `Sandbox.populate` (``cp -R --reflink=auto`` as the sandbox
   uid) against ``shutil.copytree`` + chown, and against a sandbox with no copy at all (the floor).
4. **Throughput at concurrency 1, 2, 4, 8**, scripted agent (the expert's calls), each against the same
   commands run without the sandbox (plain subprocess / host file operations in a temp copy):
   tool calls/s (bash ``ls`` + view), full expert episodes/s (reset, calls, diff), hidden-test runs/s
   (the grader vs ``python -m pytest`` on the same tree).
5. **SmolLM2** (skipped with ``--quick``): 16 episodes of the real model through the native tool-call
   format; checks that token ids, loss masks and tool calls line up and that every reward is 0 or 1.
   The 16 are played twice by base SmolLM2, without and with the engine's prefix cache (each turn then
   prefills only what it added; the cache-off run is the baseline of ``prefix_cache_speedup``).
   ``--model CHECKPOINT`` plays the same 16 prompts again with a warm-started model (`rlbus env
   trajectories` → `rlbus pretrain`): base SmolLM2 is the same-run baseline of the warm start. ``--tasks
   PREFIX`` draws the prompts from one library, e.g. one left out of the warm-start data.

``--grader`` runs phases 1 and 2 only (the grader's measurements, about an hour on two busy cores).
Absolute figures drift on shared machines; the ratios against the same-run baselines are the point.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rlbus.envs.chat import ToolCall
from rlbus.envs.swe.env import SHIPPED_CORPUS, SweEnv
from rlbus.envs.swe.expert import expert_calls
from rlbus.envs.swe.grading.cheats import ATTACK_KINDS, cheat_patches
from rlbus.envs.swe.grading.check import check_tasks
from rlbus.envs.swe.grading.grade import grade
from rlbus.envs.swe.grading.monitor import hack_kinds
from rlbus.envs.swe.patch import tree_diff
from rlbus.envs.swe.runtime import runtime_dir
from rlbus.envs.swe.task import RepoTask, load_tasks
from rlbus.envs.swe.tools import SCHEMAS, repo_tools
from rlbus.envs.swe.world import open_world, task_sandbox, template
from rlbus.errors import ConfigError
from rlbus.training.checkpoint import latest_checkpoint
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, require, write_json

if TYPE_CHECKING:
    from rlbus.models.sources import ModelSource

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "swe" / "corpus"
LEVELS = (1, 2, 4, 8)
PREFIX_CACHE_TOKENS = 16 * 6144  # every episode's whole budget (max_total_tokens) fits


def _corpora() -> list[Path]:
    return [p for p in (SHIPPED_CORPUS, FIXTURES) if p.is_dir()]


async def _timed(n: int, concurrency: int, make: Any) -> float:
    """Operations per second of ``n`` calls of the coroutine factory ``make`` with ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await make(i)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return round(n / (time.perf_counter() - start), 2)


async def _reset(task: RepoTask, n: int) -> dict[str, Any]:
    """Median ms of one episode reset: the copy by each method, and opening + closing the sandbox."""
    base = await template(task)
    times: dict[str, list[float]] = {"copytree": [], "cp": []}
    for _ in range(n):
        for method in times:
            async with task_sandbox(task) as box:
                times[method].append(await box.populate(base, "repo", method=method))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for _ in range(n):
        async with task_sandbox(task):
            pass
    open_close = (time.perf_counter() - t0) / n
    files = sum(len(f) for _, _, f in os.walk(base))

    def ms(xs: list[float]) -> float:
        return round(1000 * sorted(xs)[len(xs) // 2], 2)

    return {
        "task": task.task_id, "files": files, "copytree_ms": ms(times["copytree"]), "cp_reflink_ms": ms(times["cp"]),
        "sandbox_open_close_ms": round(1000 * open_close, 2), "chosen": "copytree",
    }  # fmt: skip


async def _throughput(task: RepoTask, quick: bool) -> list[dict[str, Any]]:
    """Tool calls, expert episodes and hidden-test runs per second, sandboxed and plain, per concurrency."""
    base = await template(task)
    calls = expert_calls(task, base)
    n_tools, n_eps, n_tests = (16, 4, 4) if quick else (48, 12, 8)
    levels = []
    for c in LEVELS:
        plain = Path(tempfile.mkdtemp(prefix="rlbus-bench-swe-"))
        try:
            shutil.copytree(base, plain / "repo")
            async with open_world(task) as world:
                tools = repo_tools(world)
                boxed_tools = await _timed(n_tools, c, partial(_tool_call, tools))
            level = {
                "concurrency": c,
                "tool_calls_per_s": {"sandbox": boxed_tools,
                                     "plain": await _timed(n_tools, c, partial(_plain_tool_call, plain / "repo"))},
                "episodes_per_s": {"sandbox": await _timed(n_eps, c, partial(_episode, task, calls)),
                                   "plain": await _timed(n_eps, c, partial(_plain_episode, task, base))},
                "hidden_test_runs_per_s": {"sandbox": await _timed(n_tests, c, partial(_hidden, task)),
                                           "plain": await _timed(n_tests, c,
                                                                 partial(_plain_hidden, task, base, plain))},
            }  # fmt: skip
        finally:
            shutil.rmtree(plain, ignore_errors=True)
        levels.append(level)
    return levels


async def _tool_call(tools: dict[str, Any], i: int) -> None:
    await (tools["bash"].run("ls") if i % 2 else tools["view"].run('{"path": "."}'))


async def _plain_tool_call(repo: Path, i: int) -> None:
    if i % 2:
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash", "-c", "ls", cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        await proc.communicate()
    else:
        await asyncio.to_thread(lambda: sorted(os.walk(repo)))


async def _episode(task: RepoTask, calls: list[tuple[str, dict[str, Any]]], i: int) -> None:
    async with open_world(task) as world:
        tools = repo_tools(world)
        for name, args in calls:
            await tools[name].run(json.dumps(args))
        await asyncio.to_thread(tree_diff, world.base, world.repo)


async def _plain_episode(task: RepoTask, base: Path, i: int) -> None:
    """The same work unsandboxed: copy, apply the solution, run the visible tests, diff."""
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-swe-") as tmp:
        repo = Path(tmp) / "repo"
        await asyncio.to_thread(shutil.copytree, base, repo)
        proc = await asyncio.create_subprocess_exec(
            "git", "apply", "-", cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "GIT_CEILING_DIRECTORIES": tmp},
        )  # fmt: skip
        await proc.communicate(task.solution.encode())
        visible = [t.split("::")[0] for t in task.fail_to_pass if (repo / t.split("::")[0]).is_file()]
        await _plain_pytest(repo, visible)
        await asyncio.to_thread(tree_diff, base, repo)


async def _hidden(task: RepoTask, i: int) -> None:
    await grade(task, task.solution)


async def _plain_hidden(task: RepoTask, base: Path, scratch: Path, i: int) -> None:
    """The hidden tests run with plain pytest on a copy (no sandbox, no launcher, no filter)."""
    repo = scratch / f"graded-{i}"
    shutil.copytree(base, repo)
    for path, content in task.hidden_tests.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(content)
    await _plain_pytest(repo, list(task.tests), task.test_env.get("PYTHONPATH", ""))


async def _plain_pytest(repo: Path, targets: list[str], extra_path: str = "") -> None:
    if not targets:
        return
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(p for p in (str(runtime_dir() / "site"),
           str(repo / extra_path) if extra_path else "") if p), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(str(runtime_dir() / "bin" / "python"), "-m", "pytest", "-q",
                                                "-p", "no:cacheprovider", *targets, cwd=repo, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    await proc.communicate()


def _caught_by(verdict: Any) -> str:
    if verdict.tampered:
        return "tampering detected"
    if verdict.dropped:
        return "dropped by the filter"
    if "forged" in verdict.reason:
        return "forged report rejected"
    if "no test report" in verdict.reason:
        return "no report (process ended early)"
    return "expected tests did not pass"


async def _cheats(tasks: list[RepoTask]) -> dict[str, Any]:
    rows = []
    for task in tasks:
        for cheat in cheat_patches(task, await template(task)):
            verdict = await grade(task, cheat.patch)
            how = _caught_by(verdict)
            rows.append({"task": task.task_id, "cheat": cheat.name, "reward": verdict.value, "caught_by": how,
                         "reason": verdict.reason[:160]})  # fmt: skip
    return {"tried": len(rows), "scored_zero": sum(r["reward"] == 0.0 for r in rows), "rows": rows}


def _load_player(model: str | None) -> tuple[str, ModelSource, dict[str, Any] | None]:
    """(label, source, the checkpoint's weights): base SmolLM2, or a checkpoint directory from `rlbus pretrain`;
    the source on the GPU when there is one."""
    import torch

    from rlbus.models.sources import ModelSource, parse_model
    from rlbus.training.checkpoint import load_checkpoint, model_from_state

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is None:
        source = parse_model("smollm2-135m-instruct", device=device)
        return "smollm2", source, None
    state = load_checkpoint(Path(model))
    if state is None:
        raise ConfigError("model", f"{model} holds no checkpoint (write one with rlbus pretrain --out)")
    policy = model_from_state(state)
    return "warm start", ModelSource.of(policy, device=device), policy.state_dict()


async def _smollm2(
    task_ids: list[str], corpus: list[str], episodes: int, model: str | None = None, prefix_cache_tokens: int = 0
) -> dict[str, Any]:
    """``episodes`` episodes of base SmolLM2 (or the checkpoint ``model``), all at once through the torch
    engine (with a prefix cache of ``prefix_cache_tokens``); per episode the layout checks (trained tokens
    only inside model turns), the calls and the reward."""
    import torch

    from rlbus.engines.torch_stack import torch_stack
    from rlbus.envs.agent import run_episode
    from rlbus.envs.base import make_env
    from rlbus.envs.episode import episode_to_rollout
    from rlbus.schemas import SamplingInfo

    label, source, weights = _load_player(model)
    if prefix_cache_tokens:
        label += " + prefix cache"
    chat = source.chat
    engine = torch_stack(
        source,
        dtype=torch.float32,
        initial=weights,
        seed=0,
        max_batch=episodes,
        prefix_cache_tokens=prefix_cache_tokens,
    ).engine
    config = {"corpus": corpus, "tasks": task_ids, "context_tokens": 4096, "max_total_tokens": 6144,
              "max_new_tokens": 128, "max_turns": 5}  # fmt: skip
    env0 = make_env("swe", config)
    assert isinstance(env0, SweEnv)
    prompts = env0.generate(0, episodes)
    t0 = time.perf_counter()

    async def play(i: int, prompt: Any) -> dict[str, Any]:
        env = make_env("swe", prompt.env_config)
        episode = await run_episode(env, prompt, engine=engine, chat=chat, sampling=SamplingInfo(temperature=0.7),
                                    episode_id=f"smollm2-{i}")  # fmt: skip
        reward = await env.score(episode, prompt)
        print(f"  [{label}] episode {i + 1}/{len(prompts)} {prompt.env_config['task']}: {episode.finish_reason}, "
              f"{episode.stats.get('tool_calls', 0)} tool calls, reward {reward.value:g}", file=sys.stderr)  # fmt: skip
        rollout = episode_to_rollout(episode, prompt=prompt, group_index=i)
        ids, mask = rollout.token_ids.to_numpy(), rollout.loss_mask.to_numpy()
        trained = [int(m) for m in mask]
        model_spans = [(t.start, t.end) for t in episode.turns if t.role == "assistant"]
        inside = all(any(a <= k < b for a, b in model_spans) for k, m in enumerate(trained) if m)
        spans_ok = episode.turns[-1].end == len(ids) and all(t.end > t.start for t in episode.turns)
        calls: Counter[str] = Counter()
        errors = []
        for t in episode.turns:  # which tools the model called, and what went wrong (from the token spans)
            text = chat.tokenizer.decode([int(i) for i in ids[t.start : t.end]])
            action = chat.parse(text, SCHEMAS) if t.role == "assistant" else None
            if isinstance(action, ToolCall):
                calls[action.name] += 1
            elif t.role == "tool" and "error:" in text:
                errors.append(text[text.index("error:") :].split("<|")[0].strip()[:120])
        return {
            "task": prompt.env_config["task"], "tokens": len(ids), "trained_tokens": sum(trained),
            "masks_ok": spans_ok and inside and sum(trained) > 0 and len(trained) == len(ids),
            "turns": episode.stats.get("turns", 0), "tool_calls": episode.stats.get("tool_calls", 0),
            "tool_errors": episode.stats.get("tool_errors", 0), "malformed": episode.stats.get("malformed", 0),
            "segments": episode.stats.get("segments", 1), "finish": episode.finish_reason, "reward": reward.value,
            "reward_in_range": reward.value in (0.0, 1.0)
            and set(reward.components) >= {"fail_to_pass", "pass_to_pass"},
            "fail_to_pass": reward.components.get("fail_to_pass"),
            "patch_bytes": len(episode.metadata.get("swe.patch", "")), "calls_by_tool": dict(calls),
            "tool_error_samples": errors[:3],
        }  # fmt: skip

    # all episodes at once: the engine batches their turns (continuous batching), the sandboxes overlap
    rows = list(await asyncio.gather(*(play(i, p) for i, p in enumerate(prompts))))
    turns = sum(r["turns"] for r in rows)
    by_tool = sum((Counter(r["calls_by_tool"]) for r in rows), Counter())
    return {"model": label, "episodes": rows, "seconds": round(time.perf_counter() - t0, 1),
            "mean_reward": round(sum(r["reward"] for r in rows) / max(1, len(rows)), 3),
            "all_masks_ok": all(r["masks_ok"] for r in rows),
            "all_rewards_in_range": all(r["reward_in_range"] for r in rows),
            "turns": turns, "tool_calls": sum(r["tool_calls"] for r in rows),
            "tool_errors": sum(r["tool_errors"] for r in rows),
            "malformed": sum(r["malformed"] for r in rows),
            "parsed_call_rate": round(sum(r["tool_calls"] for r in rows) / max(1, turns), 3),
            "episodes_with_patch": sum(r["patch_bytes"] > 0 for r in rows),
            "submitted": sum(r["finish"] == "stop" for r in rows), "calls_by_tool": dict(by_tool.most_common()),
            "prefix_cache": engine.prefix_stats, "checkpoint": model}  # fmt: skip


async def _hacks(tasks: list[RepoTask], cheats: dict[str, Any]) -> dict[str, Any]:
    """The attacks written against the grader (`ATTACK_KINDS`), by kind. ``scored_zero``: on the unfixed
    repository (the cheater suite's rows). Then each again on top of the reference solution, where the tests
    pass, so only a tamper finding of the grader scores it 0 (``detected``); ``inert`` counts the attacks
    that changed nothing there (say, a wrapper of return values on a library whose tests read none), which
    leave a correct fix that rightly scores 1; ``spoiled`` the ones that broke the fix they rode on."""
    unfixed = {(r["task"], r["cheat"]): r for r in cheats["rows"] if r["cheat"] in ATTACK_KINDS}
    rows = []
    for task in tasks:
        for attack in cheat_patches(task, await template(task), on_fixed=True):
            verdict = await grade(task, attack.patch)
            before = unfixed[(task.task_id, attack.name)]
            outcome = "detected" if verdict.tampered else "inert" if verdict.value == 1.0 else "spoiled"
            rows.append({"task": task.task_id, "library": _library(task), "attack": attack.name,
                         "kind": ATTACK_KINDS[attack.name], "reward_unfixed": before["reward"],
                         "reward_fixed": verdict.value, "fixed": outcome, "detected": outcome == "detected",
                         "monitor": hack_kinds(verdict.hacks), "reason": verdict.reason[:160]})  # fmt: skip
    by_kind: dict[str, dict[str, int]] = {}
    keys = ("tried", "scored_zero", "detected", "inert", "spoiled")
    for r in rows:
        k = by_kind.setdefault(str(r["kind"]), dict.fromkeys(keys, 0))
        k["tried"] += 1
        k["scored_zero"] += r["reward_unfixed"] == 0.0
        k[str(r["fixed"])] += 1
    total = {key: sum(k[key] for k in by_kind.values()) for key in keys}
    return {**total, "by_kind": by_kind, "rows": rows}


def _library(task: RepoTask) -> str:
    return task.metadata.get("library") or task.task_id.split("-")[0]


def _one_per_library(tasks: list[RepoTask]) -> list[RepoTask]:
    first: dict[str, RepoTask] = {}
    for task in tasks:
        first.setdefault(_library(task), task)
    return list(first.values())


def _grade_times(tasks: list[RepoTask], checks: list[Any]) -> dict[str, float]:
    """Median seconds of one grade per library (the reference's and the unchanged repository's)."""
    times: dict[str, list[float]] = {}
    for task, check in zip(tasks, checks, strict=True):
        times.setdefault(_library(task), []).extend([check.solution_s, check.unchanged_s])
    return {lib: _median(xs) for lib, xs in sorted(times.items())}


async def _run(
    quick: bool, json_path: Path | None = None, model: str | None = None, tasks_prefix: str | None = None,
    grader: bool = False,
) -> dict[str, Any]:  # fmt: skip
    corpora = _corpora()
    tasks = load_tasks(corpora)
    if tasks_prefix is not None and not any(t.task_id.startswith(tasks_prefix) for t in tasks):
        raise ConfigError("tasks", f"no task id starts with {tasks_prefix!r}")  # at start, not after the phases
    print(f"checking {len(tasks)} tasks from {', '.join(map(str, corpora))}", file=sys.stderr)
    checks = await check_tasks(tasks, lambda r: print(f"  {'ok ' if r.ok else 'FAIL'} {r.task_id} {r.problem}",
                                                      file=sys.stderr))  # fmt: skip
    valid = [t for t, r in zip(tasks, checks, strict=True) if r.ok]
    cheat_tasks = valid[:1] if quick else _one_per_library(valid)
    print(f"cheater suite on {len(cheat_tasks)} task(s)", file=sys.stderr)
    cheats = await _cheats(cheat_tasks)
    print(f"attacks on the grader, on top of the reference solution, on {len(cheat_tasks)} task(s)", file=sys.stderr)
    hacks = await _hacks(cheat_tasks, cheats)
    result: dict[str, Any] = {"checks": [r.to_dict() for r in checks], "cheats": cheats, "hacks": hacks}
    _partial(json_path, result)
    probe = (
        next(t for t in valid if t.task_id == "calc-add") if any(t.task_id == "calc-add" for t in valid) else valid[0]
    )
    sizes = {t.task_id: sum(len(f) for _, _, f in os.walk(await template(t))) for t in valid}
    largest = max(valid, key=lambda t: sizes[t.task_id])
    if not grader:
        result["reset"] = await _reset(probe, 5 if quick else 20)
        result["reset_largest"] = await _reset(largest, 5 if quick else 20)
    if not quick and not grader:
        print("throughput at concurrency 1, 2, 4, 8", file=sys.stderr)
        result["throughput"] = await _throughput(probe, quick)
        _partial(json_path, result)
        ids = [t.task_id for t in valid if tasks_prefix is None or t.task_id.startswith(tasks_prefix)]
        if not ids:
            raise ConfigError("tasks", f"no valid task id starts with {tasks_prefix!r}")
        where = [str(c) for c in corpora]
        print(f"SmolLM2: 16 episodes on {len(ids)} task(s), without then with the prefix cache", file=sys.stderr)
        result["smollm2"] = await _smollm2(ids, where, 16)
        _partial(json_path, result)
        result["smollm2_prefix_cache"] = await _smollm2(ids, where, 16, prefix_cache_tokens=PREFIX_CACHE_TOKENS)
        _partial(json_path, result)
        if model is not None:  # the same 16 prompts (same seed), the warm-started checkpoint playing
            print(f"warm start: the same 16 episodes played by {model}", file=sys.stderr)
            result["warm_start"] = await _smollm2(ids, where, 16, model, prefix_cache_tokens=PREFIX_CACHE_TOKENS)
    result["summary"] = {
        "tasks": len(tasks), "tasks_valid": len(valid), "cheats_tried": cheats["tried"],
        "cheats_scored_zero": cheats["scored_zero"],
        "reset_ms": result["reset"]["copytree_ms"] if "reset" in result else None,
        "hacks_tried": hacks["tried"], "hacks_scored_zero": hacks["scored_zero"], "hacks_detected": hacks["detected"],
        "hacks_inert_on_fixed": hacks["inert"], "hacks_spoiled_on_fixed": hacks["spoiled"],
        "hacks_by_kind": hacks["by_kind"], "attack_libraries": sorted({_library(t) for t in cheat_tasks}),
        "false_positives": {"reference_not_1": [r.task_id for r in checks if r.solution_reward != 1.0],
                            "unchanged_not_0": [r.task_id for r in checks if r.unchanged_reward != 0.0]},
        "solution_check_s_median": _median([r.solution_s for r in checks]),
        "grade_s_median": _median([r.solution_s for r in checks] + [r.unchanged_s for r in checks]),
        "grade_s": _grade_times(tasks, checks),
    }  # fmt: skip
    if "throughput" in result:
        one = result["throughput"][0]
        result["summary"].update({
            "tool_calls_per_s_c1": one["tool_calls_per_s"]["sandbox"],
            "episodes_per_s_c1": one["episodes_per_s"]["sandbox"],
            "hidden_test_runs_per_s_c1": one["hidden_test_runs_per_s"]["sandbox"],
        })  # fmt: skip
    if "smollm2_prefix_cache" in result:
        result["summary"]["prefix_cache_speedup"] = round(
            result["smollm2"]["seconds"] / max(1e-9, result["smollm2_prefix_cache"]["seconds"]), 2
        )
    for key in ("smollm2", "smollm2_prefix_cache", "warm_start"):
        if key in result:
            result["summary"][f"{key}_mean_reward"] = result[key]["mean_reward"]
            result["summary"][f"{key}_masks_ok"] = result[key]["all_masks_ok"]
            result["summary"][f"{key}_parsed_call_rate"] = result[key]["parsed_call_rate"]
    return result


def _median(xs: list[float]) -> float:
    return round(sorted(xs)[len(xs) // 2], 3) if xs else 0.0


def _partial(json_path: Path | None, result: dict[str, Any]) -> None:
    """Figures so far, next to the final file (a long run that dies keeps what it measured)."""
    if json_path is not None:
        json_path.with_suffix(".partial.json").write_text(json.dumps(result, indent=1, default=str))


def run(
    quick: bool, json_path: Path | None, model: str | None = None, tasks: str | None = None, grader: bool = False
) -> dict[str, Any]:
    """``model``: a checkpoint directory (`rlbus pretrain --out`) that plays the SmolLM2 phase's 16 prompts
    after base SmolLM2; ``tasks``: draw those prompts from task ids with this prefix (a held-out library);
    ``grader``: only the grader's phases (1 and 2)."""
    if (quick or grader) and (model is not None or tasks is not None):
        raise ConfigError("model", "--model and --tasks choose the SmolLM2 phase, which --quick and --grader skip")
    if model is not None and (not Path(model).is_dir() or latest_checkpoint(Path(model)) is None):
        raise ConfigError("model", f"{model} holds no checkpoint (write one with rlbus pretrain --out)")
    result = asyncio.run(_run(quick, json_path, model, tasks, grader))
    result["meta"] = {**{k: str(v) if isinstance(v, str) else v for k, v in meta().items()}, "quick": quick,
                      "worker_uid": os.geteuid(),
                      "note": "compare with the same-run baselines; bench/RESULTS.md gives the load"}  # fmt: skip
    s = result["summary"]
    print_table(
        "rlbus bench swe — corpus and cheater suite",
        ["tasks", "valid", "cheats tried", "scored 0", "reset ms", "grade s (median)"],
        [
            [
                s["tasks"],
                s["tasks_valid"],
                s["cheats_tried"],
                s["cheats_scored_zero"],
                s["reset_ms"],
                s["grade_s_median"],
            ]
        ],
    )
    print_table(
        f"attacks on the grader ({', '.join(s['attack_libraries'])}): scored 0 on the unfixed repository; on top "
        "of the reference solution detected, inert (changed nothing) or spoiled (broke the fix)",
        ["kind", "tried", "scored 0", "detected", "inert", "spoiled"],
        [[k, v["tried"], v["scored_zero"], v["detected"], v["inert"], v["spoiled"]]
         for k, v in sorted(s["hacks_by_kind"].items())]
        + [["all", s["hacks_tried"], s["hacks_scored_zero"], s["hacks_detected"], s["hacks_inert_on_fixed"],
            s["hacks_spoiled_on_fixed"]]],
    )  # fmt: skip
    fp = s["false_positives"]
    print_table(
        "false positives and grading time (rlbus env check on every task: reference must be 1, unchanged 0)",
        ["library", "grade s (median)", "reference not 1", "unchanged not 0"],
        [[lib, t, sum(x.startswith(lib) for x in fp["reference_not_1"]),
          sum(x.startswith(lib) for x in fp["unchanged_not_0"])] for lib, t in s["grade_s"].items()],
    )  # fmt: skip
    for r in [result[k] for k in ("reset", "reset_largest") if k in result]:
        print_table(f"episode reset ({r['task']}, {r['files']} files; median)",
                    ["copytree+lchown ms (used)", "cp --reflink=auto ms", "sandbox open+close ms"],
                    [[r["copytree_ms"], r["cp_reflink_ms"], r["sandbox_open_close_ms"]]])  # fmt: skip
    if "throughput" in result:
        rows = [
            [
                lv["concurrency"],
                *(
                    f"{lv[k]['sandbox']} / {lv[k]['plain']}"
                    for k in ("tool_calls_per_s", "episodes_per_s", "hidden_test_runs_per_s")
                ),
            ]
            for lv in result["throughput"]
        ]
        print_table(
            "throughput, sandbox / plain", ["concurrency", "tool calls/s", "episodes/s", "hidden-test runs/s"], rows
        )
    played = [result[k] for k in ("smollm2", "smollm2_prefix_cache", "warm_start") if k in result]
    if played:
        print_table("SmolLM2-135M, 16 episodes (5 turns of <= 128 tokens)",
                    ["model", "turns", "calls", "tool err", "malformed", "patches", "submits", "reward", "masks",
                     "s"],
                    [[m["model"], m["turns"], m["tool_calls"], m["tool_errors"], m["malformed"],
                      m["episodes_with_patch"], m["submitted"], m["mean_reward"], m["all_masks_ok"], m["seconds"]]
                     for m in played])  # fmt: skip
    write_json(json_path, result)
    return result


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    model: Annotated[str | None, typer.Option(
        help="A warm-start checkpoint directory (rlbus pretrain --out) played against base SmolLM2.")] = None,
    tasks: Annotated[str | None, typer.Option(
        help="The SmolLM2 episodes' task-id prefix (e.g. a held-out library).")] = None,
    grader: Annotated[bool, typer.Option(
        help="The grader's phases alone (corpus check, cheats and attacks on every library), no reset, throughput "
             "or SmolLM2.")] = False,
) -> None:
    """The coding environment: the corpus graded, the attack suite, and SmolLM2 episodes."""
    result = run(quick=quick, json_path=json_path, model=model, tasks=tasks, grader=grader)
    summary = result["summary"]
    require(summary["cheats_scored_zero"] >= summary["cheats_tried"],
            "a cheat scored above 0 (see the JSON's cheats.rows)")
