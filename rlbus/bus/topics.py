"""Topics as code: the one declarative spec ``rlbus topics create`` applies, and the typed topics.

A new major schema version is a new topic (``rl.rollouts.v2``); broker auto-create stays off, so a
typo in a topic name fails loudly instead of creating an empty topic.
"""

from __future__ import annotations

from dataclasses import replace

from rlbus.bus.topic import Topic, dlq_name
from rlbus.bus.types import TopicSpec
from rlbus.schemas import Prompt, Reward, Rollout, Served, WeightVersion

DAY_MS = 24 * 3600 * 1000

PROMPTS: Topic[Prompt] = Topic("rl.prompts.v1", Prompt, key=lambda m: m.prompt_id)
ROLLOUTS: Topic[Rollout] = Topic("rl.rollouts.v1", Rollout, key=lambda m: m.prompt_id)
REWARDS: Topic[Reward] = Topic("rl.rewards.v1", Reward, key=lambda m: m.rollout_id)
WEIGHTS: Topic[WeightVersion] = Topic("rl.weights.v1", WeightVersion, key=lambda m: m.model_id)
WEIGHTS_LATEST: Topic[WeightVersion] = Topic("rl.weights.latest.v1", WeightVersion, key=lambda m: m.model_id)
SERVED: Topic[Served] = Topic("rl.served.v1", Served, key=lambda m: m.session_id or m.served_id)

TYPED_TOPICS: dict[str, Topic[Prompt] | Topic[Rollout] | Topic[Reward] | Topic[WeightVersion] | Topic[Served]] = {
    t.name: t for t in (PROMPTS, ROLLOUTS, REWARDS, WEIGHTS, WEIGHTS_LATEST, SERVED)
}

_BASE: list[TopicSpec] = [
    TopicSpec(
        PROMPTS.name,
        partitions=12,
        config={"retention.ms": str(7 * DAY_MS), "compression.type": "producer"},
        doc="Prompts asking for a group of G rollouts; key prompt_id.",
    ),
    TopicSpec(
        ROLLOUTS.name,
        partitions=12,
        config={
            "retention.ms": str(7 * DAY_MS),
            "max.message.bytes": str(4 * 1024 * 1024),
            "compression.type": "producer",
        },
        doc="Agent episodes with tokens, behaviour log-probs, masks, MoE routing; key prompt_id.",
    ),
    TopicSpec(
        REWARDS.name,
        partitions=12,
        config={"retention.ms": str(7 * DAY_MS)},
        doc="Rewards from verifiers, judges and users; key rollout_id.",
    ),
    TopicSpec(
        WEIGHTS.name,
        partitions=1,
        config={"retention.ms": str(30 * DAY_MS)},
        doc="Delta/keyframe manifests, one partition so versions stay ordered; key model_id.",
    ),
    TopicSpec(
        WEIGHTS_LATEST.name,
        partitions=1,
        config={"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.01", "segment.ms": "60000"},
        doc="Newest manifest per model (compacted) for late joiners.",
    ),
    TopicSpec(
        SERVED.name,
        partitions=12,
        config={
            "retention.ms": str(7 * DAY_MS),
            "max.message.bytes": str(4 * 1024 * 1024),
            "compression.type": "producer",
        },
        doc="Every completion the gateway served, token-exact with per-token versions; key session or served id.",
    ),
]


def dlq_spec(spec: TopicSpec) -> TopicSpec:
    return TopicSpec(
        dlq_name(spec.name),
        partitions=1,
        replication=spec.replication,
        config={"retention.ms": str(30 * DAY_MS)},
        doc=f"Dead letters of {spec.name}: original bytes and key, headers naming the source and error.",
    )


def topic_specs(replication: int = 1, partitions: int | None = None) -> list[TopicSpec]:
    """Every rlbus topic and its dead-letter topic. ``partitions`` overrides the data topics' count
    (the weights topics stay at one partition); ``replication`` 3 with ``min.insync.replicas`` 2 for
    a three-broker cluster."""
    out: list[TopicSpec] = []
    for spec in _BASE:
        config = dict(spec.config)
        if replication >= 3:
            config["min.insync.replicas"] = "2"
        n = spec.partitions if partitions is None or spec.partitions == 1 else partitions
        data = replace(spec, replication=replication, partitions=n, config=config)
        out += [data, dlq_spec(data)]
    return out
