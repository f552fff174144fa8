"""Acceptance-length arithmetic on hand-made accept sequences."""

import math

import pytest

from eagle3_core.evaluate.acceptance import acceptance


def test_hand_made_rounds() -> None:
    # K = 3: rounds accepting 3, 0, 1 and 2 drafts -> 6 accepted over 4 rounds
    a = acceptance([3, 0, 1, 2], k=3)
    assert a.rounds == 4 and a.accepted == 6
    assert math.isclose(a.acceptance_length, 2.5)
    assert a.per_position == (0.75, 0.5, 0.25)  # first draft accepted in 3 of 4 rounds, ...
    assert math.isclose(a.acceptance_rate, 0.5)


def test_per_position_sums_to_al_minus_one() -> None:
    rounds = [0, 7, 7, 3, 5, 1, 0, 2, 6, 4, 7]
    a = acceptance(rounds, k=7)
    assert math.isclose(sum(a.per_position), a.acceptance_length - 1.0)
    assert list(a.per_position) == sorted(a.per_position, reverse=True)  # unconditional: never increases


def test_everything_rejected_and_everything_accepted() -> None:
    assert acceptance([0, 0, 0], k=4).acceptance_length == 1.0
    full = acceptance([4, 4], k=4)
    assert full.acceptance_length == 5.0 and full.per_position == (1.0, 1.0, 1.0, 1.0)
    assert full.acceptance_rate == 1.0


def test_impossible_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        acceptance([4], k=3)
    with pytest.raises(ValueError, match="positive"):
        acceptance([], k=0)
    assert math.isnan(acceptance([], k=3).acceptance_length)
