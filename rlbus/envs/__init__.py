"""Environments (docs/architecture.md §6): the harness that runs an agent episode, its world state, and its reward.

    base.py       Environment / Task protocol, HarnessConfig, Tool, World, register_env / make_env
    chat.py       ChatFormat: role openings/closings (byte tokens or derived from a chat template), the
                  tagged action format (<tool name=…>, <answer>, <summary>), render_messages
    actions.py    ToolCall / Answer / Malformed: what a turn asks for, in either action syntax
    tool_calls.py native tool calls for chat templates: JSON schemas, the Hermes prompt, <tool_call> parsing
    agent.py      the multi-turn agent loop with self-summarization (imports the engine, hence torch)
    episode.py    Episode, and its conversion to and from the Rollout message
    evaluate.py   held-out greedy evaluation of a model through the harness
    scripted.py   ScriptedEngine: replays fixed turns (reference solutions, tests)
    rewards.py    exact-match verification and the Reward builder
    sandbox.py    bubblewrap sandbox for untrusted code (``rlbus sandbox run``)
    judge.py      LM judges: rubric dimensions, local engine or OpenAI-compatible HTTP backend
    tasks/        built-in tasks (arith, strings, kv, python_fn, answer) and JSONL prompt files
    adapters/     other libraries' environments: reasoning-gym (``reasoning_gym:NAME``), verifiers
    swe/          the coding-agent environment (repositories in the sandbox, hidden tests): ``swe``

Importing this package (which Python does before any module in it) registers the built-in tasks, so
`make_env` knows them wherever it is imported from. It stays light (no torch): reward workers and the
prompt producer use it without the engine; the rollout worker imports `rlbus.envs.agent` itself.
"""

import rlbus.envs.adapters  # other libraries' environments (reasoning_gym:…), their libraries imported on use
import rlbus.envs.swe  # the coding environment registers ``swe`` as it is imported
import rlbus.envs.tasks  # noqa: F401  (each built-in task module calls register_env as it is imported)
from rlbus.envs.base import (
    Environment,
    HarnessConfig,
    Limits,
    Task,
    Tool,
    World,
    env_for,
    make_env,
    register_env,
    registered_envs,
)
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import Episode, episode_to_rollout, rollout_to_episode, segment_spans
from rlbus.errors import ToolError

__all__ = [
    "ChatFormat",
    "Environment",
    "Episode",
    "HarnessConfig",
    "Limits",
    "Task",
    "Tool",
    "ToolError",
    "World",
    "env_for",
    "episode_to_rollout",
    "make_env",
    "register_env",
    "registered_envs",
    "rollout_to_episode",
    "segment_spans",
]
