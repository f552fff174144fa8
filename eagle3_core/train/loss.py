"""The TTT objective and its metrics: soft cross-entropy against the target over the draft vocabulary.

Step k, entry p predicts token p+2+k. Its teacher is the target's distribution at position p+1+k restricted
to the draft vocabulary (softmax of target_logits[..., t2d]), and it counts where that token is the
model's own (loss_mask[p+2+k]) and the target's top token exists in the draft vocabulary (t2d[argmax]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import shift_left


@dataclass(frozen=True)
class TTTResult:
    loss: torch.Tensor  # scalar: sum_k weight**k * loss_k
    step_losses: list[float]
    acc: list[float]  # acc_k: top-1 agreement at step k (conditional: earlier steps teacher-forced)
    full_acc: list[float]  # full_acc_k: steps 0..k all right at the same entry
    counted: list[int]  # positions that count at each step

    def tau(self, k: int) -> float:
        """Estimated acceptance length at k drafts: 1 + sum_j prod_{i<=j} acc_i (DESIGN section 3)."""
        total, running = 1.0, 1.0
        for a in self.acc[:k]:
            running *= a
            total += running
        return total


def ttt_loss(
    draft_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    t2d: torch.Tensor,
    step_weight: float = 0.8,
) -> TTTResult:
    """draft_logits: steps x [B, T, V_draft]; target_logits [B, T, V_target]; loss_mask [B, T]; t2d [V_target]."""
    teacher_logp = F.log_softmax(target_logits[..., t2d].float(), dim=-1)  # [B, T, V_draft]
    in_draft = t2d[target_logits.argmax(-1)]  # [B, T]: the target's top token is draftable
    total = torch.zeros((), device=target_logits.device)
    step_losses, acc, full_acc, counted = [], [], [], []
    all_right = torch.ones_like(loss_mask, dtype=torch.bool)
    for k, logits in enumerate(draft_logits):
        teacher = shift_left(teacher_logp, k + 1, fill=0.0)
        mask = (shift_left(loss_mask, k + 2) > 0) & shift_left(in_draft, k + 1, fill=False)
        n = mask.sum().clamp(min=1)
        ce = -(teacher.exp() * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, T]
        loss_k = (ce * mask).sum() / n
        total = total + step_weight**k * loss_k
        right = logits.argmax(-1) == teacher.argmax(-1)
        all_right = all_right & right
        step_losses.append(float(loss_k))
        acc.append(float((right & mask).sum() / n))
        full_acc.append(float((all_right & mask).sum() / n))
        counted.append(int(mask.sum()))
    return TTTResult(total, step_losses, acc, full_acc, counted)
