"""The reward side (docs/architecture.md §6): the scorers a reward worker (:mod:`rlbus.consumers.reward`) scores
rollouts with, registered by name (:mod:`rlbus.rewards.scorers`) — deterministic verifiers and a user's reward
function (``verifier``), LM judges with rubrics (``judge``), a user's own; the coding environment's grader lives
with that environment (:mod:`rlbus.envs.swe`)."""
