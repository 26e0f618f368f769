"""``swe``, the coding-agent environment: a repository in the sandbox, shell and editor tools, hidden tests.

    task.py         RepoTask and its two formats: Harbor-style task directories, SWE-bench JSONL rows
    runtime.py      the sandbox's test Python (system python3 + pytest/hypothesis copied read-only) and cache
    world.py        per-task templates (materialised once) and per-episode sandboxed copies
    tools.py        bash, view, str_replace, insert, create, search, submit (JSON parameter schemas)
    patch.py        the final diff of a world, and the filter every graded patch passes
    grade.py        hidden tests on a fresh copy, under grader_main.py (runs inside the sandbox)
    split.py        the hidden tests split: assertions report computed operands, the answers stay out
    split_params.py ... a parametrisation's answer columns held aside
    grader_*.py     the launcher (main), the test process (runner), its audit hook (guard), canonical
                    values (values) and the seccomp filter (seccomp): mounted in grading sandboxes only
    expert.py       the scripted expert: the reference patch as tool calls
    cheats.py       the cheater suite: patches that try to game the grader (all must score 0)
    attacks.py      attacks on what a verdict rests on, by class (also on top of the fix)
    check.py        ``rlbus env check``: reference solution must score 1, the unchanged repo 0
    trajectories.py ``rlbus env trajectories``: expert replays as chat-format SFT rows
    env.py          SweEnv, registered as ``swe``

Importing the package registers ``swe`` (rlbus.envs.tasks imports it, so `make_env` always knows it).
"""

from rlbus.envs.swe.env import SweConfig, SweEnv
from rlbus.envs.swe.task import RepoTask, load_tasks

__all__ = ["RepoTask", "SweConfig", "SweEnv", "load_tasks"]
