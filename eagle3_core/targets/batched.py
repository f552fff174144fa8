"""The target alone over many rows at once: its forward for `batch` rows of a preallocated KV cache, each row
appending tokens at its own positions (`BatchedTarget`, the layers `GraphedTarget` runs, targets/graphed.py),
optionally keeping every forward's states (`StateRecord`), and plain decoding of many prompts with it
(`target_generate_batch`): what regeneration's batched step runs, and the evaluation's target-alone path.
Speculative decoding of many rows is evaluate/batched.py's, on the same target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_core.targets.graphed import TargetLayers

PREFILL_TOKENS = 8192  # padded prompt tokens a prefill forward takes at most (`prefill_groups`)


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy; above it, softmax(logits / T) drawn with `generator`."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One id per row of probs [..., V]."""
        return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=self.generator).reshape(
            probs.shape[:-1]
        )

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1) if self.greedy else self.draw(self.probs(logits))


class StateRecord:
    """The target's states at every position of every row: aux [B, capacity, A*H] and the final state
    [B, capacity, H] (post-norm), written at the positions each forward computes (the prompt, then each
    verification's K+1). A slot past a row's committed length holds a rejected draft's states until the next
    verification writes it again, as the KV cache's slots do; once decoding ends (with its last token run), slots
    0..len(prompt)+len(reply)-1 of a row are its committed sequence's states."""

    def __init__(self, target: TargetLayers, batch: int, capacity: int) -> None:
        config = target.model.config
        hidden = int(config.hidden_size)
        shape = (batch, capacity)
        self.aux = torch.zeros(
            *shape, len(target.aux_layer_ids) * hidden, dtype=target.dtype, device=target.device
        )
        self.final = torch.zeros(*shape, hidden, dtype=target.dtype, device=target.device)

    def write(self, rows: slice, positions: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> None:
        """aux [b, n, A*H] and final [b, n, H] at positions [b, n] of the rows `rows`."""
        for store, states in ((self.aux, aux), (self.final, final)):
            index = positions[..., None].expand(-1, -1, states.shape[-1])
            store[rows].scatter_(1, index, states)


class BatchedTarget(TargetLayers):
    """The target's forward for `batch` rows, each appending tokens at its own positions (eager: the layers
    `GraphedTarget` runs, `TargetLayers`); with `record`, every forward's states are kept there."""

    def __init__(
        self, model: Any, aux_layer_ids: tuple[int, ...], batch: int, capacity: int, record: bool = False
    ) -> None:
        super().__init__(model, aux_layer_ids)
        self.keys, self.values = self.cache(batch, capacity)
        self.record = StateRecord(self, batch, capacity) if record else None

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: slice = slice(None),
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [b, n] for the cache rows `rows` -> logits [b, n, V] (or, with `logits_at` [b], the
        logits of that entry a row: [b, 1, V]), aux states [b, n, A*H]."""
        keys, values = self.keys[:, rows], self.values[:, rows]
        logits, aux, final = self.rows_states(keys, values, ids, positions, logits_at)
        if self.record is not None:
            self.record.write(rows, positions, aux, final)
        return logits, aux

    def prefill(self, prompts: list[list[int]], first_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`prompts` (rows first_row.. of the cache) in one forward, right-padded to the longest: (each row's
        logits at its last prompt token [b, V], aux states [b, n, A*H], padding included). A padded slot past
        a row's prompt holds a pad token's entry until the row's own token at that position is written there,
        always before any query of the row can see it (slot j is read only by queries at j and later)."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        rows = slice(first_row, first_row + len(prompts))
        logits, aux = self.forward(ids, positions, rows, logits_at=last)
        return logits[:, 0], aux


def prefill_groups(prompts: list[list[int]], tokens: int | None = None) -> list[tuple[int, int]]:
    """Consecutive rows (start, end) whose prompts padded to the group's longest come to at most `tokens`
    (default PREFILL_TOKENS), or one row: the prefill's groups, bounding its activations."""
    tokens = tokens or PREFILL_TOKENS
    groups: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, prompt in enumerate(prompts):
        longest = max(longest, len(prompt))
        if i > start and longest * (i - start + 1) > tokens:
            groups.append((start, i))
            start, longest = i, len(prompt)
    groups.append((start, len(prompts)))
    return groups


# (logits [b, V] of the cache rows `rows`, the index within the reply of the tokens chosen) -> a token a row
Chooser = Callable[[torch.Tensor, slice, int], torch.Tensor]


@torch.no_grad()
def target_generate_batch(
    model: Any,
    aux_layer_ids: tuple[int, ...],
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling | None = None,
    choose: Chooser | None = None,
) -> list[list[int]]:
    """`target_generate` for every prompt at once: the target alone, each row's reply (greedy: its own), each
    ending at its first eos id or at `max_new_tokens`. The prompts are prefilled a group of rows at a time
    (`BatchedTarget.prefill`), then every row steps one token at a time (a finished row carried along, its tokens ignored). `choose`: how
    tokens are chosen in place of `sampling` (regeneration's row-seeded sampler, targets/regenerate.py)."""
    sampling = sampling or Sampling()
    pick = choose or (lambda logits, _rows, _step: sampling.choose(logits))
    device = next(model.parameters()).device
    b = len(prompts)
    target = BatchedTarget(model, aux_layer_ids, b, max(len(p) for p in prompts) + max_new_tokens + 1)
    replies: list[list[int]] = []
    for start, end in prefill_groups(prompts):
        logits, _ = target.prefill(prompts[start:end], start)
        replies += [[token] for token in pick(logits, slice(start, end), 0).tolist()]
    newest = torch.tensor([len(p) for p in prompts], device=device)
    while live := [i for i, r in enumerate(replies) if len(r) < max_new_tokens and r[-1] not in eos_ids]:
        ids = torch.tensor([[r[-1]] for r in replies], device=device)
        logits, _ = target.forward(ids, newest[:, None])
        chosen = pick(logits[:, 0], slice(None), len(replies[live[0]])).tolist()  # live rows: one length
        for i in live:
            replies[i].append(chosen[i])
        newest[live] += 1  # a finished row stays where it is
    return replies
