"""How an environment scores an episode: the one way a `Reward` is built, and exact-match verification.

Deterministic verifiers are the first kind of reward docs/architecture.md §6 reaches for. Every reward of an
episode from one source has the id ``{rollout_id}:{source}``, so a redelivered rollout scored twice produces
the same reward id and the trainer's join stays idempotent.

Exact match compares the final answer with the prompt's ``reference`` after stripping surrounding
whitespace (case and inner spacing matter: "Olleh" is not "olleh"). An episode that ended without an answer
(``max_turns``, ``length``) scores 0 with the finish reason recorded.
"""

from __future__ import annotations

import time

from rlbus.envs.episode import Episode
from rlbus.schemas import Prompt, Reward
from rlbus.schemas.reward import HACK_KINDS as HACK_KINDS  # environments report their hack monitor's findings under it


def make_reward(
    episode: Episode,
    prompt: Prompt,
    *,
    source: str,
    value: float,
    reason: str,
    components: dict[str, float] | None = None,
    metadata: dict[str, str] | None = None,
) -> Reward:
    return Reward(
        reward_id=f"{episode.episode_id}:{source}",
        rollout_id=episode.episode_id,
        prompt_id=prompt.prompt_id,
        source=source,
        value=value,
        components=components or {},
        reason=reason,
        created_at=time.time(),
        metadata=metadata or {},
    )


def normalize_answer(text: str) -> str:
    return text.strip()


def exact_match(episode: Episode, prompt: Prompt, *, expected: str | None = None) -> Reward:
    """1.0 when the answer equals ``expected`` (default: ``prompt.reference``) after stripping, else 0.0."""
    target = expected if expected is not None else prompt.reference
    if target is None:
        raise ValueError(f"prompt {prompt.prompt_id} has no reference answer to match")
    if episode.answer is None:
        reason = f"no answer (episode ended with {episode.finish_reason!r})"
        return make_reward(episode, prompt, source="verifier", value=0.0, reason=reason, components={"exact": 0.0})
    ok = normalize_answer(episode.answer) == normalize_answer(target)
    reason = "exact match" if ok else f"expected {target!r}, got {episode.answer[:200]!r}"
    value = 1.0 if ok else 0.0
    return make_reward(episode, prompt, source="verifier", value=value, reason=reason, components={"exact": value})
