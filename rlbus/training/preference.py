"""Preference pairs — the data of the offline DPO stage — and their token-exact JSONL form.

A `PreferencePair` is two continuations of the same context, the preferred (``chosen``) and the other
(``rejected``), each a token sequence with the mask of the tokens the model wrote (`SFTExample`: the prompt,
role headers and tool results are context, never scored). Pairs come from preference JSONL users already
have (text or chat ``messages``, rendered with the model's chat template, `rlbus.training.dpo`) or from a
run's own log (`rlbus.training.pairs`: each group's best and worst rollout by reward), and both end up in
the token form below, which replays exactly:

    {"chosen_ids": [...], "chosen_mask": [0, 0, 1, ...], "rejected_ids": [...], "rejected_mask": [...],
     "prompt_id": "...", "chosen_reward": 1.0, "rejected_reward": 0.0}

``prompt_id`` and the rewards are provenance (optional); the ids and masks are the pair.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.training.sft import SFTExample


@dataclass(frozen=True)
class PreferencePair:
    """A preferred and a dispreferred continuation of one context (see the module docstring)."""

    chosen: SFTExample
    rejected: SFTExample
    prompt_id: str = ""
    chosen_reward: float | None = None
    rejected_reward: float | None = None

    @property
    def margin(self) -> float | None:
        """chosen − rejected reward, when both are known."""
        if self.chosen_reward is None or self.rejected_reward is None:
            return None
        return self.chosen_reward - self.rejected_reward

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "chosen_ids": list(self.chosen.token_ids), "chosen_mask": [int(m) for m in self.chosen.trained],
            "rejected_ids": list(self.rejected.token_ids), "rejected_mask": [int(m) for m in self.rejected.trained],
        }
        if self.prompt_id:
            row["prompt_id"] = self.prompt_id
        if self.chosen_reward is not None:
            row["chosen_reward"] = self.chosen_reward
        if self.rejected_reward is not None:
            row["rejected_reward"] = self.rejected_reward
        return row

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> PreferencePair:
        """Inverse of `to_json`; ValueError names what is missing or inconsistent."""
        try:
            chosen = SFTExample(tuple(row["chosen_ids"]), tuple(bool(m) for m in row["chosen_mask"]))
            rejected = SFTExample(tuple(row["rejected_ids"]), tuple(bool(m) for m in row["rejected_mask"]))
        except KeyError as exc:
            raise ValueError(f"a token pair needs chosen_ids, chosen_mask, rejected_ids and rejected_mask: no {exc}"
                             ) from None
        return cls(chosen=chosen, rejected=rejected, prompt_id=str(row.get("prompt_id", "")),
                   chosen_reward=row.get("chosen_reward"), rejected_reward=row.get("rejected_reward"))


def write_pairs(path: Path, pairs: Iterable[PreferencePair]) -> int:
    """Write pairs as token JSONL (one object per line); returns how many."""
    n = 0
    with open(path, "w") as f:
        for pair in pairs:
            f.write(json.dumps(pair.to_json()) + "\n")
            n += 1
    return n
