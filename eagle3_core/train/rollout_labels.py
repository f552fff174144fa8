"""Labels of on-policy record tokens: which draft step of its rollout round proposed each reply token, and
whether the target rejected that draft (evaluate/rollout.py records the rounds; docs/onpolicy.md).

For a round whose newest committed token is at position n and whose verification accepted a of its K drafts:
tokens n+1..n+a are drafts 1..a (TTT steps 0..a-1, right); token n+a+1 is the target's own, at step a: a
correction (the draft at step a was wrong) when a < K, a bonus (no draft proposed it) when a = K. TTT step k
at entry p predicts token p+2+k, so the token n+1+k of that round is step k at entry n-1, as the round
computed it (train/loss.py `record_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# draft_steps labels: a token no draft step proposed (a prompt token, the prefill's first reply token, a
# bonus), and the flag added to a step where that step's draft was rejected (the token is the correction)
NOT_DRAFTED = -1
REJECTED = 64
OFFLINE = -2  # in a training batch: a token of an offline sample (or padding), which no rollout labelled


def draft_steps(prompt_length: int, verified: Sequence[int], length: int, k: int) -> torch.Tensor:
    """int8 [length]: for each token of a rollout's sample (prompt + reply, cut to `length`), the draft step
    of its round that proposed it (0..K-1), plus REJECTED where that draft was rejected and the token is the
    target's correction; NOT_DRAFTED for prompt tokens, the first reply token and bonus tokens."""
    if k >= REJECTED:
        raise ValueError(f"K={k}: draft steps are labelled below {REJECTED}")
    labels = torch.full((length,), NOT_DRAFTED, dtype=torch.int8)
    position = prompt_length + 1  # the first reply token came from the prefill
    for accepted in verified:
        for step in range(accepted + 1):
            if position >= length:
                return labels
            if step < accepted:
                labels[position] = step
            elif accepted < k:
                labels[position] = step + REJECTED
            position += 1
    return labels
