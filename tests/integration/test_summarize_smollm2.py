"""Self-summarisation on the real model, end to end: SmolLM2 plays ``kv`` tool episodes longer than the
context the run allows, summarises, continues in fresh contexts, and the trainer trains every segment.

The task config is what a run sets in ``[task] env_config`` (docs/environments.md): ``summarize =
true`` with a ``context_tokens`` budget below what the episode needs. The episodes are played by the
rollout stack's engine (bf16 SmolLM2 in the torch engine, behind the batching engine), scored by the
task's verifier, joined and handed to the trainer worker of `rlbus.wiring.trainer.trainer_stack` (fp32
SmolLM2), exactly as a distributed run does, minus the bus.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlbus.envs.agent import SUMMARY_REQUEST, run_episode
from rlbus.envs.base import env_for, make_env
from rlbus.envs.episode import episode_to_rollout
from rlbus.schemas import Prompt, SamplingInfo
from rlbus.state import MemoryStateStore
from rlbus.training.batch import sample_from_rollout
from rlbus.training.config import GRPOConfig
from rlbus.training.join import Outcome
from rlbus.wiring.trainer import trainer_stack

#: A 3-hop chain with short observations in a 400-token context: SmolLM2's native tool prompt alone is
#: ~260 tokens, so an episode needs two contexts (the second opens from the first one's summary).
KV = {"hops": 3, "keys": 4, "summarize": True, "context_tokens": 400, "max_total_tokens": 800, "max_turns": 4,
      "max_new_tokens": 32, "summary_max_tokens": 32, "max_segments": 2, "max_observation_tokens": 24}
GROUP = 2


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from rlbus.models.sources import parse_model

    return parse_model("smollm2-135m-instruct")


@pytest.mark.timeout(900)  # 249 s at load ≈ 2–7, 654 s at ≈ 13 on the 2 shared cores (mostly the fp32 step)
def test_a_summarising_smollm2_run_trains_every_segment(smollm2: Any) -> None:
    import torch

    from rlbus.engines.batching import BatchingEngine
    from rlbus.engines.torch_engine import TorchEngine

    [prompt] = make_env("kv", KV).generate(0, 1)
    prompt = Prompt(**{**{f: getattr(prompt, f) for f in prompt.__struct_fields__}, "group_size": GROUP})
    env = env_for(prompt)
    chat = smollm2.chat
    engine = BatchingEngine(TorchEngine(smollm2.build(torch.bfloat16).eval(), tokenizer=chat, seed=3,
                                        pad_id=smollm2.pad_id), max_batch=GROUP)  # fmt: skip

    async def play() -> list[Any]:
        return list(await asyncio.gather(*(
            run_episode(env, prompt, engine=engine, chat=chat, sampling=SamplingInfo(temperature=0.7),
                        episode_id=f"{prompt.prompt_id}-{i}") for i in range(GROUP))))  # fmt: skip

    episodes = asyncio.run(play())
    rollouts = [episode_to_rollout(e, prompt=prompt, group_index=i) for i, e in enumerate(episodes)]
    for episode, rollout in zip(episodes, rollouts, strict=True):
        spans = episode.segments
        assert len(spans) >= 2 and rollout.metadata["stat.segments"] == str(len(spans))
        assert all(end - start <= KV["context_tokens"] for start, end in spans)  # each fits the context
        assert len(episode.token_ids) > KV["context_tokens"]  # the episode as a whole does not
        for k in range(1, len(spans)):  # each later segment opens from the summary written at the previous end
            asked = [t for t in episode.turns if t.segment == k - 1 and t.text == SUMMARY_REQUEST]
            summary = [t for t in episode.turns if t.segment == k and t.role == "summary"]
            assert [t.role for t in asked] == ["user"] and len(summary) == 1
            written = [t for t in episode.turns if t.segment == k - 1 and t.role == "assistant"][-1]
            assert summary[0].text.strip() and summary[0].text.strip() in written.text
        trained = [t for t in episode.turns if t.role == "assistant"]
        assert {t.segment for t in trained} == set(range(len(spans)))  # the model wrote in every segment

    rewards = [asyncio.run(env.score(e, prompt)) for e in episodes]
    stack = trainer_stack(bus=None, state=MemoryStateStore(), store=None, model=smollm2.build(), lr=1e-6,  # type: ignore[arg-type]
                          grpo=GRPOConfig(micro_batch_rows=1), groups_per_step=1)  # fmt: skip

    async def train() -> dict[str, Any]:
        for rollout in rollouts:
            assert await stack.join.add_rollout(rollout) is None
        group = None
        for reward in rewards:
            group = await stack.join.add_reward(reward) or group
        assert group is not None and [s.reward for s in group.rollouts] == [r.value for r in rewards]
        metrics = await stack.worker.train([group])
        assert metrics is not None
        assert await stack.join.outcome_of(rollouts[0].rollout_id) == [Outcome.TRAINED]
        return metrics

    metrics = asyncio.run(train())
    segments = sum(len(e.segments) for e in episodes)
    assert metrics["samples"] == GROUP and metrics["rows"] == segments  # one row per context segment
    sampled = sum(int(sample_from_rollout(r).loss_mask.sum()) for r in rollouts)
    assert metrics["tokens"] == sampled  # every segment's model tokens carry the episode's reward
    for episode, reward in zip(episodes, rewards, strict=True):
        print(f"{episode.episode_id}: {len(episode.segments)} segments {episode.segments}, finish "
              f"{episode.finish_reason}, answer {episode.answer!r}, reward {reward.value} ({reward.reason})")
        for turn in episode.turns:
            if turn.role in ("summary", "assistant"):
                print(f"   [{turn.segment}] {turn.role}: {turn.text[:100]!r}")
    print("trainer:", {k: metrics[k] for k in ("samples", "rows", "tokens", "loss", "step_s")})
