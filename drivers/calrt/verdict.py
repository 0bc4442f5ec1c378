"""The answer to one §14 question: a claim, its verdict and the evidence behind it.

Pure values (no runtime access), shared by the experiments (child side) and the report
(parent side); they cross the process boundary as plain dicts (``to_dict``/``from_dict``).
"""

from __future__ import annotations

from typing import Any

import attrs

PROVEN = "proven"
DISPROVEN = "disproven"
INCONCLUSIVE = "inconclusive"
VERDICTS = (PROVEN, DISPROVEN, INCONCLUSIVE)


@attrs.frozen
class Answer:
    """``claim`` is the statement tested; ``verdict`` whether the measurements prove it,
    disprove it, or cannot tell; ``finding`` a short classification of what was observed
    (e.g. "dma", "partial", "refuses_busy"); ``evidence`` one human-readable paragraph;
    ``numbers`` the raw measurements (JSON-able)."""

    id: str
    claim: str
    verdict: str = attrs.field(validator=attrs.validators.in_(VERDICTS))
    finding: str
    evidence: str
    numbers: dict[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Answer:
        return cls(**d)


def inconclusive(qid: str, claim: str, reason: str, **numbers: Any) -> Answer:
    """An inconclusive answer whose finding and evidence are the reason."""
    return Answer(qid, claim, INCONCLUSIVE, "not_measured", reason, dict(numbers))
