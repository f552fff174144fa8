"""The TTT objective and its metrics: soft cross-entropy against the target over the draft vocabulary.

Step k, entry p predicts token p+2+k. Its teacher is the target's distribution at position p+1+k restricted
to the draft vocabulary (softmax of target_logits[..., t2d]), and it counts where that token is the
model's own (loss_mask[p+2+k]) and the target's top token exists in the draft vocabulary (t2d[argmax]).

Statistics are kept as sums (loss, right, all-right, counted per step), so that batches, log intervals and
ranks combine exactly by addition; ratios are taken only when a number is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import shift_left


@dataclass(frozen=True)
class TTTTargets:
    teacher_logp: torch.Tensor  # [B, T, V_draft]: log-softmax of the target over the draft vocab, unshifted
    masks: torch.Tensor  # [steps, B, T] bool: which entries count at each step

    def counts(self) -> torch.Tensor:
        """Counted entries per step, [steps] float64 (what a global normaliser sums over ranks)."""
        return self.masks.sum(dim=(1, 2)).to(torch.float64)


def ttt_targets(
    target_logits: torch.Tensor, loss_mask: torch.Tensor, t2d: torch.Tensor, steps: int
) -> TTTTargets:
    """target_logits [B, T, V_target], loss_mask [B, T], t2d bool [V_target] -> the teacher and the masks."""
    teacher_logp = F.log_softmax(target_logits[..., t2d].float(), dim=-1)
    in_draft = t2d[target_logits.argmax(-1)]  # [B, T]: the target's top token is draftable
    masks = torch.stack(
        [(shift_left(loss_mask, k + 2) > 0) & shift_left(in_draft, k + 1, fill=False) for k in range(steps)]
    )
    return TTTTargets(teacher_logp, masks)


@dataclass
class TTTStats:
    """Per-step sums: rows loss, right (top-1 agrees), all_right (steps 0..k all agree), counted; [4, steps]."""

    sums: torch.Tensor

    @classmethod
    def zeros(cls, steps: int, device: torch.device | None = None) -> TTTStats:
        return cls(torch.zeros(4, steps, dtype=torch.float64, device=device))

    def __add__(self, other: TTTStats) -> TTTStats:
        return TTTStats(self.sums.to(other.sums.device) + other.sums)

    def cpu(self) -> TTTStats:
        return TTTStats(self.sums.cpu())

    @property
    def counted(self) -> list[int]:
        return [int(c) for c in self.sums[3]]

    def _ratio(self, row: int) -> list[float]:
        sums = self.sums.cpu()
        return [float(x) for x in sums[row] / sums[3].clamp(min=1)]

    @property
    def step_losses(self) -> list[float]:
        return self._ratio(0)

    @property
    def acc(self) -> list[float]:
        """acc_k: top-1 agreement at step k, conditional (earlier steps teacher-forced)."""
        return self._ratio(1)

    @property
    def full_acc(self) -> list[float]:
        """full_acc_k: steps 0..k all right at the same entry."""
        return self._ratio(2)

    def tau(self, k: int) -> float:
        """Estimated acceptance length at k drafts: 1 + sum_j prod_{i<=j} acc_i (DESIGN section 3)."""
        total, running = 1.0, 1.0
        for a in self.acc[:k]:
            running *= a
            total += running
        return total

    def report(self, prefix: str = "") -> dict[str, float]:
        """Flat metrics for a log line: loss_k, acc_k, full_acc_k, tau_1..tau_steps, counted."""
        out: dict[str, float] = {}
        for k, (loss, acc, full) in enumerate(zip(self.step_losses, self.acc, self.full_acc, strict=True)):
            out[f"{prefix}loss_{k}"] = round(loss, 6)
            out[f"{prefix}acc_{k}"] = round(acc, 6)
            out[f"{prefix}full_acc_{k}"] = round(full, 6)
        for k in range(1, len(self.counted) + 1):
            out[f"{prefix}tau_{k}"] = round(self.tau(k), 6)
        out[f"{prefix}counted"] = self.counted[0]
        return out


LossKind = Literal["kl", "lk_hybrid"]
LK_ETA = 3.0  # the LK paper's best hybrid setting


def entry_loss(teacher_logp: torch.Tensor, draft_logits: torch.Tensor, kind: LossKind) -> torch.Tensor:
    """Per-entry loss [..] of draft logits [.., V] against the teacher's log-probabilities [.., V].

    kl: the soft cross-entropy, which is forward KL plus the teacher's entropy (a constant: same gradient).
    lk_hybrid: lam * KL + (1 - lam) * TV with lam = exp(-eta * alpha), alpha = sum min(p, q) the acceptance
    probability, held constant in lam; KL leads while the draft is far off, then TV, which is 1 - alpha
    itself (Samarin et al. 2026, "LK losses: direct acceptance rate optimization for speculative decoding").
    """
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    p = teacher_logp.exp()
    ce = -(p * logq).sum(-1)
    if kind == "kl":
        return ce
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    kl = ce + (p * teacher_logp).sum(-1)
    lam = torch.exp(-LK_ETA * alpha.detach())
    return lam * kl + (1.0 - lam) * (1.0 - alpha)


def ttt_loss(
    draft_logits: list[torch.Tensor],
    targets: TTTTargets,
    step_weight: float = 0.8,
    normalizer: torch.Tensor | None = None,
    loss: LossKind = "kl",
) -> tuple[torch.Tensor, TTTStats]:
    """sum_k step_weight**k * loss_k, with loss_k = (summed entry loss at step k) / normalizer[k].

    `normalizer` defaults to this batch's counts; under DDP pass the global counts times the world size, so
    that the averaged gradient equals one process's gradient on the whole global batch.
    """
    steps, t = len(draft_logits), targets.teacher_logp.shape[1]
    norm = (targets.counts() if normalizer is None else normalizer).clamp(min=1)
    total = torch.zeros((), device=targets.teacher_logp.device)
    sums = torch.zeros(
        4, steps, dtype=torch.float64, device=total.device
    )  # stays on device: no sync per step
    teacher_top = targets.teacher_logp.argmax(-1)  # [B, T]
    all_right = torch.ones_like(targets.masks[0])
    for k, logits in enumerate(draft_logits):
        # entry p of step k is taught by the target at p+1+k: slices, not shifted copies (entries past the
        # end have no teacher and are masked out anyway)
        n = t - k - 1
        teacher, mask = targets.teacher_logp[:, k + 1 :], targets.masks[k][:, :n]
        per_entry = entry_loss(teacher, logits[:, :n], loss)  # [B, n]
        loss_sum = (per_entry * mask).sum()
        total = total + step_weight**k * loss_sum / norm[k].to(loss_sum.device, loss_sum.dtype)
        right = torch.zeros_like(all_right)
        right[:, :n] = logits[:, :n].argmax(-1) == teacher_top[:, k + 1 :]
        all_right = all_right & right
        counts = [loss_sum.detach(), (right[:, :n] & mask).sum(), (all_right[:, :n] & mask).sum(), mask.sum()]
        sums[:, k] = torch.stack([c.to(torch.float64) for c in counts])
    return total, TTTStats(sums)
