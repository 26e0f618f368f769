"""``swe``, the coding-agent environment: a repository in the sandbox, shell and editor tools, hidden tests.

    task.py         RepoTask and its two formats: Harbor-style task directories, SWE-bench JSONL rows
    runtime.py      the sandbox's test Python (system python3 + pytest/hypothesis copied read-only) and cache
    world.py        per-task templates (materialised once) and per-episode sandboxed copies
    tools.py        bash, view, str_replace, insert, create, search, submit (JSON parameter schemas)
    patch.py        the final diff of a world, and the filter every graded patch passes
    grading/        the grader: hidden tests split and run under a launcher in the sandbox, the hack
                    monitor, ``rlbus env check``, and the cheats and attacks that must all score 0
    expert.py       the scripted expert: the reference patch as tool calls
    trajectories.py ``rlbus env trajectories``: expert replays as chat-format SFT rows
    env.py          SweEnv, registered as ``swe``

Importing the package registers ``swe`` (rlbus.envs.tasks imports it, so `make_env` always knows it).
"""

from rlbus.envs.swe.env import SweConfig, SweEnv
from rlbus.envs.swe.task import RepoTask, load_tasks

__all__ = ["RepoTask", "SweConfig", "SweEnv", "load_tasks"]
