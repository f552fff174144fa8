"""The pictures on the drafter_eval asset page: per-position acceptance bars, the training curves and the
serving recommendation's tokens/s at each K (PNG).

Drawn on matplotlib `Figure` objects (no pyplot, so no display and no global state; Agg renders PNG).
`markdown_image` inlines a PNG as a data URI, which the Dagster UI shows in markdown metadata.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from eagle3_core.store.atomic import atomic_write_bytes
from eagle3_core.store.records import ALRow, MetricsRow, ServingRecommendation, TrainRow, ValRow


def _save(fig: Figure, out: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(out, buffer.getvalue())
    return out


def _legend_or_note(ax: Axes, note: str, **legend: Any) -> None:
    """The axes' legend, or `note` across them when nothing was drawn (a run with no rows yet)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**legend)
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="0.4")


def acceptance_bars(
    per_position: Mapping[int, Sequence[float]], lengths: Mapping[int, float], out: Path, title: str
) -> Path:
    """Unconditional acceptance of each draft position, one group of bars per K, AL in the legend."""
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    ks = sorted(per_position)
    width = 0.8 / max(len(ks), 1)
    for j, k in enumerate(ks):
        xs = [i + 1 + (j - (len(ks) - 1) / 2) * width for i in range(len(per_position[k]))]
        ax.bar(xs, per_position[k], width=width, label=f"K={k}: AL {lengths[k]:.2f}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted (share of rounds)")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, max((len(v) for v in per_position.values()), default=0) + 1))
    ax.set_title(title)
    _legend_or_note(ax, "no acceptance measured")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out)


def training_curves(records: Sequence[MetricsRow], steps: int, out: Path, title: str) -> Path:
    """Loss of step 0 and accuracy per TTT position over optimizer steps (train and validation), and tau."""
    train = [r for r in records if isinstance(r, TrainRow)]
    val = [r for r in records if isinstance(r, ValRow)]
    fig = Figure(figsize=(11, 3.8))
    loss_ax, acc_ax = fig.subplots(1, 2)
    rows: Sequence[MetricsRow]
    for rows, style, name in ((train, "-", "train"), (val, "o--", "val")):
        if rows:
            loss_ax.plot(
                [r.step for r in rows], [r.step_losses[0] for r in rows], style, label=f"{name} loss_0"
            )
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("soft cross-entropy (nats)")
    _legend_or_note(loss_ax, "no training or validation rows")
    loss_ax.grid(alpha=0.3)
    for k in range(steps):  # train as thin lines, validation as dots, one colour per TTT position
        if train:
            acc_ax.plot(
                [r.step for r in train],
                [r.acc[k] for r in train],
                "-",
                color=f"C{k}",
                alpha=0.5,
                linewidth=1,
                label=None if val else f"acc_{k}",
            )
        if val:
            acc_ax.plot([r.step for r in val], [r.acc[k] for r in val], "o", color=f"C{k}", label=f"acc_{k}")
    acc_ax.set_xlabel("step")
    acc_ax.set_ylabel("top-1 accuracy (conditional; dots: val)")
    acc_ax.set_ylim(0, 1)
    _legend_or_note(acc_ax, "no training or validation rows", fontsize=7, ncol=2)
    acc_ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, out)


def acceptance_curve(rows: Sequence[ALRow], kept_step: int | None, out: Path, title: str) -> Path:
    """AL measured during training over optimizer steps, with its 95% interval, and the step the run kept."""
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    steps = [r.step for r in rows]
    ax.fill_between(steps, [r.al_ci95[0] for r in rows], [r.al_ci95[1] for r in rows], alpha=0.2)
    k = rows[0].k if rows else 0
    ax.plot(
        steps, [r.al for r in rows], "o-", label=f"AL at K={k} ({rows[0].prompts if rows else 0} prompts)"
    )
    kept = [r for r in rows if r.step == kept_step]
    if kept:
        ax.plot([kept[0].step], [kept[0].al], "*", markersize=14, label=f"kept: step {kept[0].step}")
    ax.set_xlabel("step")
    ax.set_ylabel("acceptance length")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out)


def serving_curves(recommendation: ServingRecommendation, out: Path, title: str) -> Path:
    """Expected speculative tokens/s over plain decoding's at each K, one line per batch size, the K chosen
    starred (none where plain decoding is faster: the line stays below 1)."""
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    ks = range(1, recommendation.measured_k + 1)
    for i, c in enumerate(recommendation.by_batch):
        ratios = [s / c.plain_tokens_per_s for s in c.tokens_per_s]
        ax.plot(ks, ratios, "o-", color=f"C{i}", label=f"batch {c.batch_size}: K={c.k}")
        if c.k:
            ax.plot([c.k], [ratios[c.k - 1]], "*", color=f"C{i}", markersize=14)
    ax.axhline(1.0, color="0.4", linewidth=1, linestyle="--")
    ax.set_xlabel("K (drafts a round)")
    ax.set_ylabel("tokens/s over plain decoding")
    ax.set_xticks(list(ks))
    ax.set_title(title)
    _legend_or_note(ax, recommendation.unmeasured or "no batch size measured", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out)


def markdown_image(path: Path, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"
