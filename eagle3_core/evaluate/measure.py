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

At temperature 0 speculative decoding must give the target's greedy output: each K counts the prompts
where it did not (`greedy_mismatches`), which is 0 in float32 and may not be in bfloat16, where a K+1-token
verification forward and a 1-token step round differently.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.acceptance import Acceptance, acceptance
from eagle3_core.evaluate.specdec import DraftDecoder, Sampling, speculative_generate, target_generate


@dataclass(frozen=True)
class DecodeSettings:
    ks: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0


@dataclass
class PathTiming:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Measurement:
    """One drafter on one prompt set: acceptance at each K, and the speed of every path."""

    prompts: int
    acceptance: dict[int, Acceptance]
    speculative: dict[int, PathTiming]
    target: PathTiming
    greedy_mismatches: dict[int, int] = field(default_factory=dict)

    def speedup(self, k: int) -> float:
        base = self.target.tokens_per_s
        return self.speculative[k].tokens_per_s / base if base else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "target_tokens_per_s": round(self.target.tokens_per_s, 2),
            "by_k": {
                str(k): {
                    **a.as_metadata(),
                    "per_position": [round(x, 4) for x in a.per_position],
                    "tokens_per_s": round(self.speculative[k].tokens_per_s, 2),
                    "speedup": round(self.speedup(k), 4),
                    **(
                        {"greedy_mismatches": self.greedy_mismatches[k]}
                        if k in self.greedy_mismatches
                        else {}
                    ),
                }
                for k, a in self.acceptance.items()
            },
        }


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
) -> Measurement:
    """Decode every prompt with the target alone and with the drafter at each K; pool the rounds per K."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    sampling = Sampling(settings.temperature, generator if settings.temperature > 0 else None)

    def target(p: list[int]) -> list[int]:
        return target_generate(model, p, settings.max_new_tokens, eos_ids, sampling)

    # one drafter cache for every prompt and K: its CUDA graphs are captured once, during the warm-up
    longest = max((len(p) for p in prompts), default=0)
    decoder = DraftDecoder(drafter, longest + settings.max_new_tokens + max(settings.ks) + 1, graphs=True)

    def spec(p: list[int], k: int) -> Any:
        return speculative_generate(
            model, drafter, d2t, aux_layer_ids, p, settings.max_new_tokens, k, eos_ids, sampling, decoder
        )

    with _attention_without_cudnn():
        return _measure(target, spec, device, prompts, settings, progress)


def _attention_without_cudnn() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _measure(
    target: Callable[[list[int]], list[int]],
    spec: Callable[[list[int], int], Any],
    device: torch.device,
    prompts: Sequence[list[int]],
    settings: DecodeSettings,
    progress: Callable[[int, int], None],
) -> Measurement:
    if prompts:  # warm-up: kernels chosen, allocator primed, lazy imports done
        target(prompts[0])
        for k in settings.ks:
            spec(prompts[0], k)
    rounds: dict[int, list[int]] = {k: [] for k in settings.ks}
    spec_time = {k: PathTiming() for k in settings.ks}
    base = PathTiming()
    outputs: dict[int, list[int]] = {}
    mismatches = dict.fromkeys(settings.ks, 0)
    paths = [0, *settings.ks]  # 0: the target alone
    for i, prompt in enumerate(prompts):
        shift = i % len(paths)  # each path goes first as often as the others
        for path in paths[shift:] + paths[:shift]:
            if path == 0:
                reference, seconds = _timed(device, partial(target, prompt))
                base.tokens += len(reference)
                base.seconds += seconds
                outputs[0] = reference
            else:
                result, seconds = _timed(device, partial(spec, prompt, path))
                rounds[path].extend(result.accepted)
                spec_time[path].tokens += len(result.tokens)
                spec_time[path].seconds += seconds
                outputs[path] = result.tokens
        for k in settings.ks:
            mismatches[k] += int(outputs[k] != outputs[0])
        progress(i + 1, len(prompts))
    return Measurement(
        prompts=len(prompts),
        acceptance={k: acceptance(rounds[k], k) for k in settings.ks},
        speculative=spec_time,
        target=base,
        greedy_mismatches=mismatches if settings.temperature == 0 else {},
    )
