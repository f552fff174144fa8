"""Acceptance length from what a speculative decoder did, round by round (docs/design.md, section 6).

Each verification round drafts K tokens and accepts the longest agreeing prefix, `accepted` in 0..K, and
then commits accepted + 1 tokens (the target's own next token comes free). So:

    AL                      = 1 + sum(accepted) / rounds      (tokens committed per target forward)
    acceptance at position i = share of rounds whose first i+1 drafts were all accepted (unconditional)
    acceptance rate         = (AL - 1) / K

Per-position values sum to AL - 1, which is how the report is checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Acceptance:
    k: int
    rounds: int
    accepted: int  # draft tokens accepted over all rounds
    per_position: tuple[float, ...]  # [K]: unconditional acceptance of draft position i

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return (self.acceptance_length - 1.0) / self.k


def acceptance(accepted_per_round: Iterable[int], k: int) -> Acceptance:
    """Pool rounds (from any number of prompts) into AL and per-position acceptance at K drafts."""
    if k <= 0:
        raise ValueError(f"K must be positive, got {k}")
    counts = [0] * (k + 1)  # counts[a]: rounds that accepted exactly a drafts
    for a in accepted_per_round:
        if not 0 <= a <= k:
            raise ValueError(f"a round accepted {a} drafts, outside 0..{k}")
        counts[a] += 1
    rounds = sum(counts)
    at_least = [sum(counts[i + 1 :]) for i in range(k)]  # rounds whose first i+1 drafts were accepted
    per_position = tuple(n / rounds if rounds else 0.0 for n in at_least)
    return Acceptance(k, rounds, sum(a * n for a, n in enumerate(counts)), per_position)
