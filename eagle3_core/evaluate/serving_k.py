"""The serving recommendation: the K to draft at each batch size, from measured acceptance and measured costs.

A server decodes b sequences at once. Plain decoding advances every row by one token a target step; speculative
decoding at K advances a row by the tokens a round commits, at the cost of the round:

    plain decoding      b tokens per target forward of width 1                      tokens/s = b / T(b, 1)
    a round of K drafts K drafter steps, then one target forward of width K + 1     seconds  = K D(b) + T(b, K + 1)
                        committing E_K = 1 + p_1 + ... + p_K tokens a row           tokens/s = b E_K / seconds

T(b, w) is the target's forward over w tokens a row and D(b) one drafter step, both at batch size b, measured
on the device the evaluation ran on (evaluate/step_costs.py). The first draft of a round comes from the
drafter's pass over the tokens the previous round committed; it is counted as one drafter step like the others.

p_i is acceptance.py's `per_position[i - 1]`: the share of the evaluation's rounds whose first i drafts were
all accepted. It is unconditional, so it is already the product a_1 a_2 ... a_i of the conditional rates
(a_j: draft j accepted given drafts 1..j-1 were), and E_K = 1 + sum_{i<=K} prod_{j<=i} a_j is 1 plus its
first K entries. Drafting is a chain (draft i depends only on the drafts before it), so the p_i measured in
rounds of the largest evaluated K hold for every smaller K. Acceptance does not depend on the batch size; the
costs do: at a small batch a forward costs about the same at any width (reading the weights dominates), at a
large one the extra width is paid in full, and the best K falls, to 0 where no K beats plain decoding.

Everything here is arithmetic on the records (no torch), so that `eagle3 serve-command` reads it cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3_core.store.records import BatchChoice, ServingRecommendation, StepCosts

# vLLM's table gives K for inclusive batch-size ranges; the last range runs to here, far beyond any
# max_num_seqs, so that the largest measured batch size's K holds above it, as it does in SGLang's table
VLLM_LAST_BATCH_SIZE = 65536


def expected_tokens_per_round(per_position: Sequence[float], k: int) -> float:
    """E_K = 1 + p_1 + ... + p_K: the tokens a round of K drafts commits on average (the accepted drafts, and
    the target's own token after them)."""
    if not 1 <= k <= len(per_position):
        raise ValueError(f"K={k} needs acceptance at positions 1..{k}; {len(per_position)} were measured")
    return 1.0 + sum(per_position[:k])


def round_seconds(costs: StepCosts, k: int) -> float:
    """K drafter steps and the verification of K drafts (the target's forward of width K + 1)."""
    return k * costs.drafter_s + costs.target_s[k]


def plain_tokens_per_s(costs: StepCosts) -> float:
    """b tokens per plain decode step (the target's forward of width 1)."""
    return costs.batch_size / costs.target_s[0]


def speculative_tokens_per_s(costs: StepCosts, per_position: Sequence[float], k: int) -> float:
    """b rows, E_K tokens each, per round of K drafts."""
    return costs.batch_size * expected_tokens_per_round(per_position, k) / round_seconds(costs, k)


def best_k(plain: float, speculative: Sequence[float]) -> int:
    """The K (1-based index into `speculative`) with the most tokens/s, or 0 where none beats `plain`; the
    smaller K on a tie, as it wastes less of the target's width."""
    k = max(range(len(speculative)), key=lambda i: (speculative[i], -i), default=-1) + 1
    return k if k and speculative[k - 1] > plain else 0


def choose(costs: StepCosts, per_position: Sequence[float]) -> BatchChoice:
    """The K at one batch size, with the figures it was chosen from."""
    measured_k = len(costs.target_s) - 1
    plain = plain_tokens_per_s(costs)
    speculative = [speculative_tokens_per_s(costs, per_position, k) for k in range(1, measured_k + 1)]
    return BatchChoice(
        batch_size=costs.batch_size,
        k=best_k(plain, speculative),
        plain_tokens_per_s=round(plain, 3),
        tokens_per_s=[round(s, 3) for s in speculative],
    )


def recommend(per_position: Sequence[float], costs: Sequence[StepCosts]) -> list[BatchChoice]:
    """The K at each batch size timed, in the order timed."""
    return [choose(c, per_position) for c in costs]


# ---- the engines' arguments ---------------------------------------------------------------------------------
def serving_file(eval_dir: Path, fmt: str) -> Path:
    """The recommendation beside the evaluation's report-<format>.json (steps/evaluation.py `report_file`)."""
    return eval_dir / f"serving-{fmt}.json"


def sglang_config_file(eval_dir: Path, fmt: str) -> Path:
    """SGLang's adaptive table for the recommendation in `serving_file(eval_dir, fmt)`."""
    return eval_dir / f"sglang-adaptive-{fmt}.json"


def sglang_adaptive_config(recommendation: ServingRecommendation) -> dict[str, dict[str, list[int]]]:
    """What `--speculative-adaptive-config` reads (SGLang 0.5.23, speculative/adaptive_spec_params.py): per
    batch size, as a string key, the speculative steps it may choose from. SGLang takes a batch to the largest
    key at or below its size; one candidate each pins the K chosen there (0: no drafting)."""
    return {str(c.batch_size): {"candidate_steps": [c.k]} for c in recommendation.by_batch}


def vllm_per_batch_size(recommendation: ServingRecommendation) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: [first, last, K] for inclusive batch-size ranges from 1,
    each measured batch size's K up to the next one's."""
    sizes = [c.batch_size for c in recommendation.by_batch]
    ends = [b - 1 for b in sizes[1:]] + [max(VLLM_LAST_BATCH_SIZE, sizes[-1])]
    return [[c.batch_size, end, c.k] for c, end in zip(recommendation.by_batch, ends, strict=True)]


def k_by_batch_size(recommendation: ServingRecommendation) -> str:
    """`1:3 4:3 16:1 64:0`: the K chosen at each batch size, in a line."""
    return " ".join(f"{b}:{k}" for b, k in recommendation.best_k().items())


def basis(recommendation: ServingRecommendation) -> str:
    """What the figures come from, in a line."""
    r = recommendation
    return (
        f"acceptance measured on the {r.prompt_set} prompts (rounds of K={r.measured_k}, temperature "
        f"{r.temperature:g}), step times measured "
        f"on {r.device} ({r.dtype}; median of {r.repeats}, {r.context_tokens} tokens in each row's cache)"
    )


def _at_choice(choice: BatchChoice) -> float:
    """Tokens/s at the K chosen (plain decoding's at K 0)."""
    return choice.tokens_per_s[choice.k - 1] if choice.k else choice.plain_tokens_per_s


def recommendation_lines(recommendation: ServingRecommendation) -> list[str]:
    """The figures each K was chosen from, a line a batch size, as `eagle3 serve-command` prints them."""
    lines = [f"from {basis(recommendation)}; tokens/s expected from them:"]
    for c in recommendation.by_batch:
        chosen = _at_choice(c)
        lines.append(
            f"  batch {c.batch_size}: K={c.k}, {chosen:.1f} tokens/s against {c.plain_tokens_per_s:.1f} plain "
            f"({chosen / c.plain_tokens_per_s:.2f}x); at K=1..{len(c.tokens_per_s)}: "
            + " ".join(f"{s:.1f}" for s in c.tokens_per_s)
        )
    return lines


def recommendation_markdown(recommendation: ServingRecommendation) -> str:
    """The table the drafter_eval asset page shows: each batch size's K and the tokens/s it came from."""
    r = recommendation
    if r.unmeasured is not None:
        return f"No serving recommendation: {r.unmeasured}."
    rows = [
        f"The K to draft at each batch size (0: plain decoding), from {basis(r)}; tokens/s expected from them.",
        "",
        "| batch size | K | plain tokens/s | tokens/s at K | speedup | tokens/s at K=1.. |",
        "|---|---|---|---|---|---|",
    ]
    for c in r.by_batch:
        chosen = _at_choice(c)
        rows.append(
            f"| {c.batch_size} | {c.k} | {c.plain_tokens_per_s:.1f} | {chosen:.1f} | "
            f"{chosen / c.plain_tokens_per_s:.2f}x | {' '.join(f'{s:.1f}' for s in c.tokens_per_s)} |"
        )
    return "\n".join(rows)
