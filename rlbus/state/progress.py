"""The counters in the state store that tie the run's processes together, and their names: one owner.

The trainer, the prompt producer, the observers (``rlbus status``, the collector) and the chaos rig read
and write these across processes, so each name is defined once, here, and imported by all of them::

    trainer:version         newest policy version the trainer has published (admission's staleness bound)
    trainer:groups_done     groups the trainer has finished with, trained or dropped (admission's count)
    trainer:groups_freed    groups that ended without moving the trainer towards a version (admission's credit)
    prompts:seq             prompts the run has admitted: the next prompt's sequence number
    outcome:<name>          rollouts per outcome of the trainer's join ("trained", "dropped_stale" …)
"""

from __future__ import annotations

#: Newest policy version the trainer has published.
VERSION_COUNTER = "trainer:version"
#: Groups the trainer has finished with (trained or dropped).
GROUPS_DONE_COUNTER = "trainer:groups_done"
#: Groups that ended without a trainer step to show for them: every rollout dropped in a step that trained
#: nothing, dropped whole at the join (incomplete at its timeout) or skipped as a gap in prompt order. Each
#: frees its admission slot (`rlbus.producers.prompts`, "Groups that end untrained").
GROUPS_FREED_COUNTER = "trainer:groups_freed"
#: Prompts the run has admitted (the next prompt's sequence number).
PROMPT_SEQ = "prompts:seq"


def outcome_counter(outcome: str) -> str:
    """The counter of rollouts that reached ``outcome`` (an :class:`rlbus.training.join.Outcome`)."""
    return f"outcome:{outcome}"
