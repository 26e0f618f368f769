"""The warm start RL begins from: supervised steps on reference solutions of a built-in task, played
through the real harness, optionally from a *sloppy teacher*.

A sloppy teacher answers ``n + 1`` instead of ``n`` on a share ``teacher_error`` of its examples (numeric
answers only). The policy learns the task and the teacher's habit with it, so its greedy answer is often
the habit while the right answer is among its samples: imitation cannot tell the habit from the skill, an
exact-match verifier can. `rlbus demo` uses 0.55 to give RL something visible to fix in a few minutes;
a production run's default is a clean teacher (0).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from msgspec.structs import replace

from rlbus.envs.agent import reference_episode
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat
from rlbus.envs.tasks import generate_prompts
from rlbus.models.base import TrainableLM
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.schemas import Prompt
from rlbus.training.sft import SFTExample, pretrain


def sft_examples(prompts: list[Prompt], chat: ChatFormat) -> list[SFTExample]:
    """Reference solutions played through the real harness, each prompt in its own environment (its
    ``env_config``: a kv prompt's table). Exactly the tokens a policy rollout would sample are trained —
    the model's turns — never the prompt, headers or tool results between them. Blocking (runs its own
    event loop: call it from a thread)."""

    async def one(prompt: Prompt) -> SFTExample:
        task: Any = env_for(prompt)
        episode = await reference_episode(task, prompt, chat=chat)
        return SFTExample(tuple(episode.token_ids), tuple(bool(m) for m in episode.loss_mask))

    async def all_examples() -> list[SFTExample]:
        return [await one(p) for p in prompts]

    return asyncio.run(all_examples())


def sloppy_teacher(prompts: list[Prompt], error: float, *, seed: int) -> list[Prompt]:
    """The warm-start references of a teacher that answers ``n + 1`` instead of ``n`` on a fraction
    ``error`` of the examples (seeded). Non-numeric references are left as they are."""
    rng = random.Random(seed)
    out = []
    for prompt in prompts:
        reference = prompt.reference or ""
        if reference.lstrip("-").isdigit() and rng.random() < error:
            prompt = replace(prompt, reference=str(int(reference) + 1))
        out.append(prompt)
    return out


def warm_start(
    model: TrainableLM, *, env: str, env_config: dict[str, Any] | None, seed: int, steps: int, lr: float,
    teacher_error: float = 0.0, examples: int = 400, batch_size: int = 32, chat: ChatFormat | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> None:
    """``steps`` supervised steps of ``model`` on ``examples`` reference solutions of ``env`` (seed + 1),
    a share ``teacher_error`` of them off by one, rendered in the model's ``chat`` format (the byte
    format by default). Blocking: run it in a thread."""
    train = generate_prompts(env, seed=seed + 1, n=examples, config=env_config)
    train = sloppy_teacher(train, teacher_error, seed=seed)
    chat = chat or ChatFormat.for_byte_tokenizer(ByteTokenizer())
    pretrain(model, sft_examples(train, chat), steps=steps, lr=lr, batch_size=batch_size, seed=seed, on_step=on_step)
