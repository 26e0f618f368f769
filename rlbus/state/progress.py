"""The counters in the state store that tie the run's processes together, and their names: one owner.

The trainer, the prompt producer, the observers (``rlbus status``, the collector) and the chaos rig read
and write these across processes, so each name is defined once, here, and imported by all of them::

    trainer:version         newest policy version the trainer has published (admission's staleness bound)
    trainer:groups_done     groups the trainer has finished with, trained or dropped (admission's count)
    prompts:seq             prompts the run has admitted: the next prompt's sequence number
    outcome:<name>          rollouts per outcome of the trainer's join ("trained", "dropped_stale" …)
"""

from __future__ import annotations

#: Newest policy version the trainer has published.
VERSION_COUNTER = "trainer:version"
#: Groups the trainer has finished with (trained or dropped).
GROUPS_DONE_COUNTER = "trainer:groups_done"
#: Prompts the run has admitted (the next prompt's sequence number).
PROMPT_SEQ = "prompts:seq"


def outcome_counter(outcome: str) -> str:
    """The counter of rollouts that reached ``outcome`` (an :class:`rlbus.state.join.Outcome`)."""
    return f"outcome:{outcome}"
