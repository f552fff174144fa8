"""Acceptance length and speed of a drafter, measured by decoding the same prompts with and without it.

For every prompt, in turn: the target alone and speculative decoding at each K, the order rotated from one
prompt to the next. Interleaving the paths per prompt keeps slow drift (clocks, caches, other load) out of
the ratio, and rotating them spreads whatever the first decode of a prompt pays over every path. The target
runs the same way in every path (transformers eager forward, DynamicCache, batch 1); on a GPU the drafter's
rounds replay as CUDA graphs (see specdec), captured during the warm-up; each timing is closed by a
synchronisation.
The first prompt is decoded once by every path, untimed, as warm-up. cuDNN's attention is kept out: it builds
an execution plan for every new sequence length (milliseconds each), which bills whichever path meets a
length first (on an H200 with the m toy target, the target alone ran at 49.8 tokens/s with it and 106.8
without, in two runs of bench/gpu_pipeline.py).

The speedup is the median over prompts of each prompt's ratio (speculative tokens/s over the target's on
that prompt, decoded back to back), and the AL comes with a 95% bootstrap interval over prompts, so two
measurements can be told apart from noise. Per-prompt results are kept in the report.

At temperature 0 speculative decoding must give the target's greedy output: each K counts the prompts
where it did not (`greedy_mismatches`), which is 0 in float32 and may not be in bfloat16, where a K+1-token
verification forward and a 1-token step round differently.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.acceptance import Acceptance, acceptance
from eagle3_core.evaluate.batched import speculative_generate_batch
from eagle3_core.evaluate.prompts import EvalPrompt
from eagle3_core.evaluate.specdec import DraftDecoder, speculative_generate, target_generate
from eagle3_core.store.records import KMeasurement, PromptResult
from eagle3_core.targets.batched import Sampling
from eagle3_core.targets.graphed import GraphedTarget


@dataclass(frozen=True)
class DecodeSettings:
    ks: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    graphed_target: bool = False  # the target's step as an engine runs it (targets/graphed.py)


@dataclass
class PathTiming:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class PromptRun:
    """One prompt decoded at one K, beside the target alone on the same prompt in the same rotation."""

    accepted: tuple[int, ...]  # emitted drafts per verification round
    spec: PathTiming
    target: PathTiming

    @property
    def speedup(self) -> float:
        """Speculative tokens/s over the target's on this prompt (nan when either was not timed)."""
        base, spec = self.target.tokens_per_s, self.spec.tokens_per_s
        return spec / base if base and spec else float("nan")


BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def bootstrap_al_interval(runs: Sequence[PromptRun], level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval of the pooled AL, resampling prompts (rounds within a prompt are not
    independent: one hard prompt gives many short rounds). Seeded, so one measurement gives one interval."""
    if not runs:
        return float("nan"), float("nan")
    accepted = np.array([sum(r.accepted) for r in runs], dtype=np.float64)
    rounds = np.array([len(r.accepted) for r in runs], dtype=np.float64)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    picks = rng.integers(0, len(runs), size=(BOOTSTRAP_RESAMPLES, len(runs)))
    al = pooled_al(accepted[picks], rounds[picks])
    al = al[np.isfinite(al)]
    if not al.size:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(al, [tail, 100 - tail])
    return float(lo), float(hi)


def pooled_al(accepted: np.ndarray, rounds: np.ndarray) -> np.ndarray:
    """1 + accepted / rounds, summed over the last axis (prompts): the AL of the pooled rounds."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(1.0 + accepted.sum(axis=-1) / rounds.sum(axis=-1))


@dataclass(frozen=True)
class PairedDifference:
    """AL(challenger) - AL(incumbent) on the same prompts, with its paired-bootstrap interval."""

    difference: float
    ci95: tuple[float, float]
    prompts: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "difference": round(self.difference, 4),
            "ci95": [round(self.ci95[0], 4), round(self.ci95[1], 4)],
            "prompts": self.prompts,
        }


def paired_al_difference(
    challenger: Sequence[PromptRun], incumbent: Sequence[PromptRun], level: float = 0.95
) -> PairedDifference:
    """The pooled-AL difference of two drafters decoded on the same prompts, in the same order, and its
    percentile interval from resampling prompts: each resample takes the same prompts for both drafters, so
    what a prompt does to both (an easy prompt lifts both) cancels, and the interval is that of the difference.
    """
    if len(challenger) != len(incumbent):
        raise ValueError(f"paired runs need the same prompts: {len(challenger)} against {len(incumbent)}")
    if not challenger:
        return PairedDifference(float("nan"), (float("nan"), float("nan")), 0)
    a = np.array([[sum(r.accepted), len(r.accepted)] for r in challenger], dtype=np.float64)
    b = np.array([[sum(r.accepted), len(r.accepted)] for r in incumbent], dtype=np.float64)
    point = float(pooled_al(a[:, 0], a[:, 1]) - pooled_al(b[:, 0], b[:, 1]))
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    picks = rng.integers(0, len(a), size=(BOOTSTRAP_RESAMPLES, len(a)))
    diffs = pooled_al(a[picks, 0], a[picks, 1]) - pooled_al(b[picks, 0], b[picks, 1])
    diffs = diffs[np.isfinite(diffs)]
    if not diffs.size:
        return PairedDifference(point, (float("nan"), float("nan")), len(a))
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(diffs, [tail, 100 - tail])
    return PairedDifference(point, (float(lo), float(hi)), len(a))


def pooled_runs_al(runs: Sequence[PromptRun], k: int) -> float:
    """The AL of every round of these prompts at draft length k (nan without a round)."""
    return acceptance((a for r in runs for a in r.accepted), k).acceptance_length


def median_speedup(runs: Sequence[PromptRun]) -> float:
    """The median over prompts of each prompt's speculative-over-target speed ratio: both paths decoded that
    prompt back to back, so load that comes and goes cancels within a ratio, and the median ignores the few
    prompts a burst of it still hit."""
    ratios = [r.speedup for r in runs if not math.isnan(r.speedup)]
    return float(statistics.median(ratios)) if ratios else float("nan")


@dataclass
class Measurement:
    """One drafter on one prompt set: acceptance at each K, and the speed of every path, prompt by prompt."""

    prompts: int
    runs: dict[int, list[PromptRun]]
    device: str = "cpu"
    greedy_mismatches: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance(self) -> dict[int, Acceptance]:
        return {k: acceptance((a for r in runs for a in r.accepted), k) for k, runs in self.runs.items()}

    @property
    def target(self) -> PathTiming:
        """The target alone, over every prompt (timed once per prompt; the runs of each K share it)."""
        first = next(iter(self.runs.values()), [])
        return PathTiming(sum(r.target.tokens for r in first), sum(r.target.seconds for r in first))

    def speculative(self, k: int) -> PathTiming:
        runs = self.runs[k]
        return PathTiming(sum(r.spec.tokens for r in runs), sum(r.spec.seconds for r in runs))

    def speedup(self, k: int) -> float:
        return median_speedup(self.runs[k])

    def al_interval(self, k: int) -> tuple[float, float]:
        return bootstrap_al_interval(self.runs[k])

    def as_dict(self) -> dict[str, Any]:
        """The measurement as a report's set holds it, less the set's own facts (bench results write it)."""
        return {
            "prompts": self.prompts,
            "device": self.device,
            "target_tokens_per_s": round(self.target.tokens_per_s, 2),
            "by_k": {str(k): self.k_measurement(k).dump() for k in self.runs},
        }

    def k_measurement(self, k: int, prompts: Sequence[EvalPrompt] | None = None) -> KMeasurement:
        """The rounds at K pooled, with each prompt's result (named by `prompts`, in the order decoded)."""
        a = acceptance((a for r in self.runs[k] for a in r.accepted), k)
        lo, hi = self.al_interval(k)
        names = (
            [(None, None)] * len(self.runs[k]) if prompts is None else [(p.id, p.category) for p in prompts]
        )
        return KMeasurement(
            k=a.k,
            rounds=a.rounds,
            acceptance_length=round(a.acceptance_length, 4),
            acceptance_rate=round(a.acceptance_rate, 4),
            al_ci95=[round(lo, 4), round(hi, 4)],
            per_position=[round(x, 4) for x in a.per_position],
            tokens_per_s=round(self.speculative(k).tokens_per_s, 2),
            speedup=round(self.speedup(k), 4),
            speedup_statistic="median over prompts of the per-prompt ratio",
            per_prompt=[
                PromptResult(
                    al=round(1 + sum(r.accepted) / len(r.accepted), 4) if r.accepted else None,
                    rounds=len(r.accepted),
                    accepted=sum(r.accepted),
                    speedup=None if math.isnan(r.speedup) else round(r.speedup, 4),
                    id=prompt_id,
                    category=category,
                )
                for r, (prompt_id, category) in zip(self.runs[k], names, strict=True)
            ],
            greedy_mismatches=self.greedy_mismatches.get(k),
        )


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def measure(
    model: Any,
    drafter: Eagle3Drafter,
    d2t: torch.Tensor,
    aux_layer_ids: tuple[int, ...],
    prompts: Sequence[list[int]],
    eos_ids: set[int],
    settings: DecodeSettings,
    progress: Callable[[int, int], None] = lambda _done, _total: None,
    references: Sequence[list[int]] | None = None,
    target_alone: bool = True,
) -> Measurement:
    """Decode every prompt with the target alone and with the drafter at each K; pool the rounds per K.

    `references`: the target's own replies to `prompts` (`target_references` with these settings), when
    several drafters are measured on the same prompts: the target-alone path is then not decoded again, and
    its speed is not timed (each run's speedup is nan). `target_alone` False: no target-alone path at all,
    for acceptance alone (the rounds are the same; no speed against the target, no greedy check)."""
    device = next(model.parameters()).device
    sampling = decode_sampling(settings, device)

    # one drafter cache (and one graphed target) for every prompt and K: their CUDA graphs are captured
    # once, during the warm-up
    longest = max((len(p) for p in prompts), default=0)
    capacity = longest + settings.max_new_tokens + max(settings.ks) + 1
    decoder = DraftDecoder(drafter, capacity, graphs=True)
    graphed: GraphedTarget | None = None

    def target(p: list[int]) -> list[int]:
        return target_generate(model, p, settings.max_new_tokens, eos_ids, sampling, graphed)

    def spec(p: list[int], k: int) -> Any:
        return speculative_generate(
            model,
            drafter,
            d2t,
            aux_layer_ids,
            p,
            settings.max_new_tokens,
            k,
            eos_ids,
            sampling,
            decoder,
            graphed,
        )

    with attention_without_cudnn():  # the graphed target's probe and graphs use the same kernels as its steps
        if settings.graphed_target:
            widths = {1, *(k + 1 for k in settings.ks)}
            graphed = GraphedTarget(model, aux_layer_ids, capacity, graph_widths=widths)
        return _measure(target, spec, device, prompts, settings, progress, references, target_alone)


def measure_acceptance(
    model: Any,
    drafter: Eagle3Drafter,
    d2t: torch.Tensor,
    aux_layer_ids: tuple[int, ...],
    prompts: Sequence[list[int]],
    eos_ids: set[int],
    settings: DecodeSettings,
    batch_size: int,
    references: Sequence[list[int]] | None = None,
) -> Measurement:
    """What `measure` gives of acceptance, decoding `batch_size` prompts at once (evaluate/batched.py): each
    prompt's rounds at each K (greedy: the very rounds `measure` decodes), and with `references` (the target's
    own replies) the greedy check. No speed: batched rounds say nothing of a batch-1 step, so every path's
    seconds are 0 (time the speedup with `measure`)."""
    if references is not None and len(references) != len(prompts):
        raise ValueError(f"{len(references)} references for {len(prompts)} prompts")
    device = next(model.parameters()).device
    sampling = decode_sampling(settings, device)
    runs: dict[int, list[PromptRun]] = {k: [] for k in settings.ks}
    mismatches = dict.fromkeys(settings.ks, 0)
    for k in settings.ks:
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start : start + batch_size])
            decoded = speculative_generate_batch(
                model, drafter, d2t, aux_layer_ids, chunk, settings.max_new_tokens, k, eos_ids, sampling
            )
            for offset, result in enumerate(decoded):
                reference = references[start + offset] if references is not None else None
                alone = PathTiming(len(reference) if reference is not None else 0, 0.0)
                runs[k].append(PromptRun(tuple(result.accepted), PathTiming(len(result.tokens), 0.0), alone))
                mismatches[k] += int(reference is not None and result.tokens != reference)
    checked = settings.temperature == 0 and references is not None
    return Measurement(len(prompts), runs, device.type, mismatches if checked else {})


def decode_sampling(settings: DecodeSettings, device: torch.device) -> Sampling:
    """How `settings` choose tokens on `device`: greedy at temperature 0, else drawn with a generator seeded
    by settings.seed."""
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    return Sampling(settings.temperature, generator if settings.temperature > 0 else None)


def target_references(
    model: Any,
    aux_layer_ids: tuple[int, ...],
    prompts: Sequence[list[int]],
    eos_ids: set[int],
    settings: DecodeSettings,
) -> list[list[int]]:
    """The target's own reply to each prompt, as `measure` decodes it (greedy: the reference every
    speculative output must equal), for `measure(..., references=)`."""
    sampling = decode_sampling(settings, next(model.parameters()).device)
    capacity = max((len(p) for p in prompts), default=0) + settings.max_new_tokens + 1
    with attention_without_cudnn():
        graphed = (
            GraphedTarget(model, aux_layer_ids, capacity, graph_widths={1})
            if settings.graphed_target
            else None
        )
        return [
            target_generate(model, p, settings.max_new_tokens, eos_ids, sampling, graphed) for p in prompts
        ]


def attention_without_cudnn() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _measure(
    target: Callable[[list[int]], list[int]],
    spec: Callable[[list[int], int], Any],
    device: torch.device,
    prompts: Sequence[list[int]],
    settings: DecodeSettings,
    progress: Callable[[int, int], None],
    references: Sequence[list[int]] | None = None,
    target_alone: bool = True,
) -> Measurement:
    if references is not None and len(references) != len(prompts):
        raise ValueError(f"{len(references)} references for {len(prompts)} prompts")
    if references is not None and not target_alone:
        raise ValueError("references stand for the target-alone path: not without it")
    decode_target = references is None and target_alone
    if prompts:  # warm-up: kernels chosen, allocator primed, lazy imports done
        if decode_target:
            target(prompts[0])
        for k in settings.ks:
            spec(prompts[0], k)
    runs: dict[int, list[PromptRun]] = {k: [] for k in settings.ks}
    mismatches = dict.fromkeys(settings.ks, 0)
    paths = [*([0] if decode_target else []), *settings.ks]  # 0: the target alone
    for i, prompt in enumerate(prompts):
        shift = i % len(paths)  # each path goes first as often as the others
        outputs: dict[int, list[int]] = {}
        timings: dict[int, PathTiming] = {}
        if references is not None:  # decoded before, not timed
            outputs[0], timings[0] = references[i], PathTiming(len(references[i]), 0.0)
        elif not target_alone:
            timings[0] = PathTiming()
        accepted: dict[int, tuple[int, ...]] = {}
        for path in paths[shift:] + paths[:shift]:
            if path == 0:
                outputs[0], seconds = _timed(device, partial(target, prompt))
            else:
                result, seconds = _timed(device, partial(spec, prompt, path))
                outputs[path], accepted[path] = result.tokens, tuple(result.accepted)
            timings[path] = PathTiming(len(outputs[path]), seconds)
        for k in settings.ks:
            runs[k].append(PromptRun(accepted[k], timings[k], timings[0]))
            if 0 in outputs:
                mismatches[k] += int(outputs[k] != outputs[0])
        progress(i + 1, len(prompts))
    return Measurement(
        prompts=len(prompts),
        runs=runs,
        device=device.type,
        greedy_mismatches=mismatches if settings.temperature == 0 and target_alone else {},
    )
