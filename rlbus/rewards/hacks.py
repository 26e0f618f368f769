"""What a reward becomes when its environment's hack monitor found reward hacking (``[reward] hack_policy``).

The coding environment's monitor (`rlbus.envs.swe.grading.monitor`) names what it found in the reward's metadata
(`Reward.hack_kinds`); the reward worker applies the run's policy to every reward before it is published, and
counts what was found by kind.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rlbus.schemas import Reward

HackPolicy = Literal["zero", "penalty", "flag"]


def apply_hack_policy(reward: Reward, policy: HackPolicy, penalty: float) -> Reward:
    """``reward`` under the run's ``[reward] hack_policy`` when its environment found hacking
    (`Reward.hack_kinds`: ``HACK_KINDS`` in its metadata, or a tampered test run): ``zero`` scores 0,
    ``penalty`` subtracts ``penalty`` (not below 0), ``flag`` keeps the value. The reason says what was
    found and what was done; the metadata keeps the value before."""
    kinds = ",".join(reward.hack_kinds)
    if not kinds or policy == "flag":
        return reward
    value = 0.0 if policy == "zero" else max(0.0, reward.value - penalty)
    reason = f"hack monitor found {kinds} (hack_policy {policy}: {reward.value:g} → {value:g}); {reward.reason}"
    metadata = {**reward.metadata, "value_before_hack_policy": f"{reward.value:g}"}
    return msgspec.structs.replace(reward, value=value, reason=reason[:2000], metadata=metadata)
