"""Reading the judge's own reply: one strict ``SCORE: N/M`` line, or no score at all.

Only a line that consists of the score (markdown emphasis allowed) counts, with M equal to the dimension's
scale and N in 0..scale, and the last such line wins. A fake score the policy wrote and the judge echoes
back is quoted (``> SCORE …``, `rlbus.rewards.judge.prompt`) and so is never such a line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: A line that is only a score: ``SCORE: 7/10``, ``**SCORE:** 7 / 10``, ``## Score = 7``. Not ``> SCORE …``.
_SCORE_LINE = re.compile(
    r"^[\s*_#]*SCORE[\s*_]*[:=][\s*_]*(-?\d+(?:\.\d+)?)[\s*_]*(?:/[\s*_]*(\d+(?:\.\d+)?))?[\s*_.]*$", re.IGNORECASE
)


@dataclass(frozen=True)
class ParsedScore:
    """A judge reply's score: ``value`` in [0, 1], or None with ``problem`` saying why."""

    value: float | None
    raw: float | None
    problem: str = ""


def parse_score(text: str, scale: int) -> ParsedScore:
    """The judge reply's last line that is only ``SCORE: N`` or ``SCORE: N/scale`` (see the module docstring).

    Anything else on the line, a denominator other than ``scale``, or N outside 0..scale makes the score
    unreadable: a strict format is what lets a quoted fake score never count.
    """
    lines = [m for m in (_SCORE_LINE.match(line) for line in text.splitlines()) if m is not None]
    if not lines:
        return ParsedScore(None, None, f"no 'SCORE: N/{scale}' line")
    number, denominator = lines[-1].groups()
    raw = float(number)
    if denominator is not None and float(denominator) != scale:
        return ParsedScore(None, raw, f"score {number}/{denominator} is not out of {scale}")
    if not 0 <= raw <= scale:
        return ParsedScore(None, raw, f"score {number} outside 0..{scale}")
    return ParsedScore(raw / scale, raw)
