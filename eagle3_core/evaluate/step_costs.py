"""What a decode step costs at each batch size, measured on this device: the costs evaluate/serving_k.py weighs.

At each batch size b, on a cache of b rows holding `context` tokens each:

    the target's forward over w tokens a row, w = 1..K_max + 1   (BatchedTarget: the layers the evaluation's
                                                                  graphed step runs, targets/graphed.py)
    one drafter step, one draft a row                            (DraftDecoder.rows_step and the argmax,
                                                                  as evaluate/specdec.py drafts)

Each is run once untimed (kernels chosen, buffers allocated), then `repeats` times, and the median kept; on a
GPU each timing is closed by a synchronisation. The caches hold zeros: a step's cost depends on their shape,
not their values (attention reads every slot of a row, masked by position), so nothing is prefilled. On a GPU
the steps run eagerly, without CUDA graphs: at a small batch that bills host overhead an engine does not pay.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.specdec import DraftDecoder
from eagle3_core.store.records import StepCosts
from eagle3_core.targets.batched import BatchedTarget


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """`fn` run once untimed, then `repeats` times: the median of those timings, in seconds."""

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


@torch.no_grad()
def target_step_seconds(
    model: Any,
    aux_layer_ids: tuple[int, ...],
    batch: int,
    widths: Sequence[int],
    context: int,
    repeats: int,
) -> list[float]:
    """The target's forward over each width w of tokens a row, appended after `context` tokens, at `batch`
    rows. UnsupportedTargetError (targets/graphed.py) for a target the batched step does not compute."""
    target = BatchedTarget(model, aux_layer_ids, batch, context + max(widths))
    device = target.device
    seconds = []
    for width in widths:
        ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        positions = torch.arange(context, context + width, device=device).expand(batch, width)
        seconds.append(median_seconds(partial(target.forward, ids, positions), repeats, device))
    return seconds


@torch.no_grad()
def drafter_step_seconds(drafter: Eagle3Drafter, batch: int, context: int, repeats: int) -> float:
    """One drafter step at `batch` rows after `context` entries: one token and state a row in, its draft out."""
    weight = drafter.lm_head.weight
    decoder = DraftDecoder(drafter, context + 1, rows=batch)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=weight.device)
    state = torch.zeros(batch, 1, drafter.cfg.hidden_size, dtype=weight.dtype, device=weight.device)
    positions = torch.full((batch, 1), context, device=weight.device)

    def step() -> torch.Tensor:
        logits, _ = decoder.rows_step(tokens, state, positions)
        return logits.argmax(-1)

    return median_seconds(step, repeats, weight.device)


def measure_step_costs(
    model: Any,
    drafter: Eagle3Drafter,
    aux_layer_ids: tuple[int, ...],
    batch_sizes: Sequence[int],
    max_k: int,
    context: int,
    repeats: int,
    log: Callable[[str], None] = lambda _: None,
) -> list[StepCosts]:
    """Each batch size's costs: the target at widths 1..max_k + 1 and one drafter step."""
    widths = range(1, max_k + 2)
    out = []
    for batch in batch_sizes:
        target_s = target_step_seconds(model, aux_layer_ids, batch, widths, context, repeats)
        drafter_s = drafter_step_seconds(drafter, batch, context, repeats)
        log(
            f"step costs at batch {batch}: target {' '.join(f'{s * 1e3:.2f}' for s in target_s)} ms at width "
            f"1..{max_k + 1}, drafter {drafter_s * 1e3:.2f} ms"
        )
        out.append(StepCosts(batch_size=batch, target_s=target_s, drafter_s=drafter_s))
    return out
