"""The reward side (docs/architecture.md §6): deterministic verifiers and a user's reward function
(``verifier``), LM judges with rubrics (``judge``). The reward worker (:mod:`rlbus.consumers.reward`) scores
rollouts with them; the coding environment's grader lives with that environment (:mod:`rlbus.envs.swe`)."""
