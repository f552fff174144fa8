"""The TTT objective and its metrics: soft cross-entropy against the target over the draft vocabulary.

Step k, entry p predicts token p+2+k. Its teacher is the target's distribution at position p+1+k restricted
to the draft vocabulary (softmax of target_logits[..., t2d]), and it counts where that token is the
model's own (loss_mask[p+2+k]) and the target's top token exists in the draft vocabulary (t2d[argmax]). In a
packed batch it counts only where token p+2+k is of the same sample as entry p.

Statistics are kept as sums (loss, right, all-right, counted per step), so that batches, log intervals and
ranks combine exactly by addition; ratios are taken only when a number is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, Literal

import torch
import torch.nn.functional as F

from eagle3_core.config import RecordLoss
from eagle3_core.draft.model import shift_left
from eagle3_core.store.records import TTTMetrics
from eagle3_core.train.rollout_labels import OFFLINE, REJECTED


@dataclass(frozen=True)
class TTTTargets:
    """The teacher in its smallest exact form: the target's logits over the draft vocabulary in the dtype
    they were computed in (bf16 under autocast) and their log-sum-exp, rather than a float32 log-softmax."""

    teacher_logits: torch.Tensor  # [B, T, V_draft], unshifted
    teacher_lse: torch.Tensor  # [B, T] float32: logsumexp of teacher_logits, so logp = logits - lse
    teacher_top: torch.Tensor  # [B, T] int64: the teacher's top draft id
    masks: torch.Tensor  # [steps, B, T] bool: which entries count at each step
    # int64 [B, N]: the entries the drafter's states are of (`Packing.drafted`), None: all T of them
    entries: torch.Tensor | None = None
    # float32 [steps, B, T]: what each counted entry weighs (`record_weights`); None: 1 each
    weights: torch.Tensor | None = None

    def counts(self) -> torch.Tensor:
        """Counted entries per step, each by its weight, [steps] float64 (what a global normaliser sums over
        ranks)."""
        if self.weights is None:
            return self.masks.sum(dim=(1, 2)).to(torch.float64)
        return (self.masks * self.weights).sum(dim=(1, 2)).to(torch.float64)

    def logp(self, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        """The teacher's float32 log-probabilities over the draft vocabulary at [rows, cols]."""
        return self.teacher_logits[rows, cols].float() - self.teacher_lse[rows, cols, None]

    def step(self, k: int) -> StepEntries:
        """Where step k's entries find their teacher (entry p at p+1+k) and which of them count."""
        b, t = self.teacher_lse.shape
        device = self.teacher_lse.device
        entries = self.entries if self.entries is not None else torch.arange(t, device=device).expand(b, t)
        rows = torch.arange(b, device=device)[:, None] * t
        # past the row's end there is no teacher: any index will do, as the mask is false there
        weight = None if self.weights is None else self.weights[k].gather(1, entries)
        return StepEntries(
            (entries + 1 + k).clamp(max=t - 1) + rows, self.masks[k].gather(1, entries), weight
        )


@dataclass(frozen=True)
class StepEntries:
    """One TTT step's N entries: the flat index [B, N] of each one's teacher in the [B * T] teacher rows,
    bool [B, N] whether it counts, and float32 [B, N] what it weighs (None: 1 each)."""

    teacher: torch.Tensor
    mask: torch.Tensor
    weight: torch.Tensor | None = None

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> its rows at the entries' teachers, [B, N, ...]."""
        flat = x.reshape(-1, *x.shape[2:]).index_select(0, self.teacher.reshape(-1))
        return flat.view(*self.teacher.shape, *x.shape[2:])


def step_masks(
    loss_mask: torch.Tensor, in_draft: torch.Tensor, steps: int, doc: torch.Tensor | None = None
) -> torch.Tensor:
    """[steps, B, T]: entry p of step k counts where token p+2+k is the model's own, the target's top token
    at p+1+k is draftable, and (given the packed batch's `doc` [B, T]) token p+2+k is of entry p's sample."""
    masks = []
    for k in range(steps):
        mask = (shift_left(loss_mask, k + 2) > 0) & shift_left(in_draft, k + 1, fill=False)
        if doc is not None:
            mask &= shift_left(doc, k + 2, fill=-1) == doc
        masks.append(mask)
    return torch.stack(masks)


def record_weights(targets: TTTTargets, draft_steps: torch.Tensor, loss: RecordLoss) -> TTTTargets:
    """`targets` with the on-policy records of the batch counted as `loss` says (config.RecordLoss), from
    each token's rollout label, draft_steps int8 [B, T] (train/rollout_labels.py; OFFLINE for offline tokens).

    Step k of entry p predicts token p+2+k: decoding visited that (entry, step) when the token's label is
    step k, and it was the drafter's error when the label also carries REJECTED."""
    masks, weights = [], []
    for k, mask in enumerate(targets.masks):
        label = shift_left(draft_steps, k + 2, fill=OFFLINE).long()
        visited = (label >= 0) & (label % REJECTED == k)
        if loss.positions == "visited":
            mask = mask & (visited | (label == OFFLINE))
        masks.append(mask)
        error = visited & (label >= REJECTED)
        weights.append(torch.where(error, loss.error_weight, 1.0).float())
    return replace(targets, masks=torch.stack(masks), weights=torch.stack(weights))


def drafted_entries(
    loss_mask: torch.Tensor, doc: torch.Tensor, steps: int, block: int
) -> torch.Tensor | None:
    """int64 [B, M]: the entries of a packed batch some step's loss may count (`step_masks` short of the
    teacher's part, so a superset of what counts, found on the host without the GPU), ascending, then the
    row's last entry (which never counts: nothing follows it) up to M, the longest row's count rounded up to
    a multiple of `block` (flex attention's); None when that is every entry (nothing to leave out)."""
    counts = torch.zeros(loss_mask.shape, dtype=torch.bool)
    for k in range(steps):
        counts |= (shift_left(loss_mask, k + 2) > 0) & (shift_left(doc, k + 2, fill=-1) == doc)
    b, t = counts.shape
    m = min(t, max(1, -(-int(counts.sum(1).max()) // block)) * block)
    if m == t:
        return None
    entries = torch.full((b, m), t - 1, dtype=torch.int64)
    for row in range(b):
        where = counts[row].nonzero().squeeze(1)
        entries[row, : where.numel()] = where
    return entries


def ttt_targets(
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    t2d: torch.Tensor,
    steps: int,
    doc: torch.Tensor | None = None,
    entries: torch.Tensor | None = None,
) -> TTTTargets:
    """target_logits [B, T, V_target], loss_mask [B, T], t2d bool [V_target] -> the teacher and the masks, for
    the drafter's states at `entries` [B, N] (None: every entry)."""
    restricted = target_logits[..., t2d]
    return TTTTargets(
        restricted,
        torch.logsumexp(restricted.float(), dim=-1),
        restricted.argmax(-1),
        step_masks(loss_mask, t2d[target_logits.argmax(-1)], steps, doc),
        entries,
    )


def chunked_ttt_targets(
    target_logits_of: Callable[[torch.Tensor], torch.Tensor],
    last: torch.Tensor,
    loss_mask: torch.Tensor,
    t2d: torch.Tensor,
    steps: int,
    chunk_tokens: int,
    doc: torch.Tensor | None = None,
    entries: torch.Tensor | None = None,
) -> TTTTargets:
    """`ttt_targets` of target_logits_of(last) [B, T, H_t] -> [.., V_target], `chunk_tokens` tokens at a time,
    so the full-vocabulary logits (163,840 wide for Kimi-K2.5) never exist for the whole batch at once."""
    b, t, _ = last.shape
    flat = last.reshape(b * t, -1)
    draft_ids = t2d.nonzero().squeeze(1)
    parts, in_draft = [], []
    for start in range(0, b * t, chunk_tokens):
        full = target_logits_of(flat[start : start + chunk_tokens])  # [c, V_target]
        in_draft.append(t2d[full.argmax(-1)])
        parts.append(full.index_select(-1, draft_ids))
    restricted = torch.cat(parts).view(b, t, -1)
    return TTTTargets(
        restricted,
        torch.logsumexp(restricted.float(), dim=-1),
        restricted.argmax(-1),
        step_masks(loss_mask, torch.cat(in_draft).view(b, t), steps, doc),
        entries,
    )


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
        """Estimated acceptance length at k drafts: 1 + sum_j prod_{i<=j} acc_i (docs/design.md, section 6)."""
        total, running = 1.0, 1.0
        for a in self.acc[:k]:
            running *= a
            total += running
        return total

    def metrics(self) -> TTTMetrics:
        """The figures a metric log row and the run summary record: loss_k, acc_k, full_acc_k, tau_1..tau_steps,
        counted (rounded to 6 places)."""
        return TTTMetrics(
            step_losses=[round(x, 6) for x in self.step_losses],
            acc=[round(x, 6) for x in self.acc],
            full_acc=[round(x, 6) for x in self.full_acc],
            tau=[round(self.tau(k), 6) for k in range(1, len(self.counted) + 1)],
            counted=self.counted[0],
        )


LossKind = Literal["kl", "lk_hybrid"]
LK_ETA = 3.0  # the LK paper's best hybrid setting


def top_k_teacher(teacher_logp: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """The teacher's log-probabilities [.., V] truncated to its `top_k` most likely ids S and renormalised
    over them (log p_i - logsumexp_S log p; -inf outside S); unchanged when top_k is None or >= V.

    HASS's top-K distillation (Zhang et al. 2024, "Learning Harmonized Representations for Speculative
    Sampling"): the draft is taught where acceptance is decided, the target's top tokens. Renormalised here,
    so that lk_hybrid's KL and TV compare two distributions. HASS itself does not renormalise, and adds its
    term to the full-vocabulary one: HArmonizedSS/HASS train/main_hass.py, compute_loss, takes
    -sum(plogp.gather(topk(target_p, k).indices)) with target_p the full softmax (topk_w 1.0 beside p_w 0.1
    for the full soft CE). For kl, its term is ours times the teacher's mass on S: the same minimiser, with
    entries weighed by that mass.
    """
    if top_k is None or top_k >= teacher_logp.shape[-1]:
        return teacher_logp  # the truncation is a no-op: the untruncated loss exactly
    keep = torch.zeros_like(teacher_logp, dtype=torch.bool).scatter_(
        -1, teacher_logp.topk(top_k).indices, True
    )
    kept = teacher_logp.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def _p_logp(p: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """p * logp with 0 where p is 0 (logp -inf: truncated, or a -inf teacher logit), not 0 * -inf = NaN;
    finite logp is left as it is, so the untruncated loss is unchanged to the bit."""
    return p * logp.clamp(min=torch.finfo(logp.dtype).min)


def entry_loss(
    teacher_logp: torch.Tensor, draft_logits: torch.Tensor, kind: LossKind, top_k: int | None = None
) -> torch.Tensor:
    """Per-entry loss [..] of draft logits [.., V] against the teacher's log-probabilities [.., V].

    kl: the soft cross-entropy, which is forward KL plus the teacher's entropy (a constant: same gradient).
    lk_hybrid: lam * KL + (1 - lam) * TV with lam = exp(-eta * alpha), alpha = sum min(p, q) the acceptance
    probability, held constant in lam; KL leads while the draft is far off, then TV, which is 1 - alpha
    itself (Samarin et al. 2026, "LK losses: direct acceptance rate optimization for speculative decoding").
    top_k: p is the teacher truncated to its top_k ids and renormalised (`top_k_teacher`); q stays the draft's
    softmax over the whole draft vocabulary, so kl is -sum_{i in S} p_i log q_i.
    """
    teacher_logp = top_k_teacher(teacher_logp, top_k)
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    p = teacher_logp.exp()
    ce = -(p * logq).sum(-1)
    if kind == "kl":
        return ce
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    kl = ce + _p_logp(p, teacher_logp).sum(-1)
    lam = torch.exp(-LK_ETA * alpha.detach())
    return lam * kl + (1.0 - lam) * (1.0 - alpha)


def ttt_loss(
    draft_logits: list[torch.Tensor],
    targets: TTTTargets,
    step_weight: float = 0.8,
    normalizer: torch.Tensor | None = None,
    loss: LossKind = "kl",
    teacher_top_k: int | None = None,
) -> tuple[torch.Tensor, TTTStats]:
    """sum_k step_weight**k * loss_k, with loss_k = (summed entry loss at step k) / normalizer[k].

    The plain form, from each step's whole logits [B, N, V_draft] (N: the drafter's entries, targets.entries,
    or all T): autograd keeps them all for backward.
    `normalizer` defaults to this batch's counts; under DDP pass the global counts times the world size, so
    that the averaged gradient equals one process's gradient on the whole global batch. `teacher_top_k`:
    the teacher truncated to its top ids (`top_k_teacher`; None: the whole draft vocabulary).
    """
    teacher_logp = targets.logp()
    total = torch.zeros((), device=targets.teacher_logits.device)
    entries = []
    for k, logits in enumerate(draft_logits):
        at = targets.step(k)
        per_entry = entry_loss(at.rows_of(teacher_logp), logits, loss, teacher_top_k)  # [B, N]
        total = total + (per_entry * _entry_weights(targets, k, at, step_weight, normalizer)).sum()
        entries.append((at, per_entry, logits.argmax(-1)))
    return total, _step_sums(entries, targets)


def lean_ttt_loss(
    states: list[torch.Tensor],
    lm_head: torch.Tensor,
    targets: TTTTargets,
    step_weight: float = 0.8,
    normalizer: torch.Tensor | None = None,
    loss: LossKind = "kl",
    compute_dtype: torch.dtype = torch.float32,
    chunk_tokens: int | None = None,
    teacher_top_k: int | None = None,
) -> tuple[torch.Tensor, TTTStats]:
    """`ttt_loss` of draft logits lm_head(states[k]), never holding a step's float32 [B, N, V_draft] logits.

    states: `steps` x [B, N, H] (the drafter's normed states at targets.entries), lm_head [V_draft, H]. Each
    step's logits are made `chunk_tokens` entries at a time, and their gradient with them (HeadLoss): the
    loss keeps each step's gradient for its state and one float32 gradient for lm_head for backward, not the
    float32 logits, log-softmax and teacher probabilities the plain form keeps (several GiB a step at 16k
    tokens and 32k draft ids). `teacher_top_k` as in `ttt_loss`.
    """
    grads = torch.is_grad_enabled() and (lm_head.requires_grad or any(s.requires_grad for s in states))
    at = tuple(targets.step(k) for k in range(len(states)))
    coefs = tuple(_entry_weights(targets, k, a, step_weight, normalizer) for k, a in enumerate(at))
    chunk = chunk_tokens or default_chunk_tokens(lm_head.shape[0])
    spec = HeadSpec(targets, at, coefs, loss, teacher_top_k, chunk, grads, compute_dtype)
    total, per_entry, top = HeadLoss.apply(spec, lm_head, *[s.to(compute_dtype) for s in states])
    return total, _step_sums(list(zip(at, per_entry, top, strict=True)), targets)


def default_chunk_tokens(draft_vocab: int) -> int:
    """Entries per chunk so that one float32 [chunk, V_draft] tensor is about 256 MiB."""
    return max(64, (1 << 26) // draft_vocab)


def _entry_weights(
    targets: TTTTargets, k: int, at: StepEntries, step_weight: float, normalizer: torch.Tensor | None
) -> torch.Tensor:
    """[B, N] float32: what each of step k's entries weighs in the total (0 where it does not count)."""
    norm = (targets.counts() if normalizer is None else normalizer).clamp(min=1)
    counted = at.mask.float() if at.weight is None else at.mask * at.weight
    return counted * (step_weight**k / norm[k].to(at.mask.device, torch.float32))


def _step_sums(
    entries: list[tuple[StepEntries, torch.Tensor, torch.Tensor]], targets: TTTTargets
) -> TTTStats:
    """The per-step sums (loss, right, all right, counted) from each step's (entries, entry loss [B, N], draft
    top id [B, N])."""
    sums = torch.zeros(4, len(entries), dtype=torch.float64, device=targets.teacher_logits.device)
    all_right: torch.Tensor | None = None  # the sums stay on the device: no sync per step
    for k, (at, per_entry, top) in enumerate(entries):
        right = top == at.rows_of(targets.teacher_top)
        all_right = right if all_right is None else all_right & right
        loss_sum = (per_entry.detach() * at.mask).sum()
        counts = [loss_sum, (right & at.mask).sum(), (all_right & at.mask).sum(), at.mask.sum()]
        sums[:, k] = torch.stack([c.to(torch.float64) for c in counts])
    return TTTStats(sums)


def entry_loss_and_grad(
    teacher_logits: torch.Tensor,
    teacher_lse: torch.Tensor,
    logits: torch.Tensor,
    coef: torch.Tensor,
    kind: LossKind,
    top_k: int | None,
    grads: bool,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`entry_loss` [m] of draft logits [m, V] against a teacher chunk, the draft's top ids [m], and, if
    `grads`, the gradient of sum(coef * loss) by the logits [m, V] (computed in float32, returned in
    `grad_dtype`: the cast the plain form's autocast makes too), written out:

    kl: d/dz = q * sum(p) - p.  lk_hybrid: lam * (q * sum(p) - p) - (1 - lam) * (m*q - q * sum(m*q)), where
    m = (q < p) is where min(p, q) takes q, and lam is held constant as in `entry_loss`. With `top_k`, p is
    the truncated teacher (`top_k_teacher`, 0 outside its top ids): the same formulas, NaN-free.
    """
    teacher_logp = top_k_teacher(teacher_logits.float() - teacher_lse[..., None], top_k)
    p = teacher_logp.exp()
    logq = F.log_softmax(logits.float(), dim=-1)
    q = logq.exp()
    ce = -(p * logq).sum(-1)
    top = logits.argmax(-1)
    kl_grad = q * p.sum(-1, keepdim=True) - p
    if kind == "kl":
        return ce, top, (kl_grad * coef[..., None]).to(grad_dtype) if grads else None
    alpha = torch.minimum(p, q).sum(-1)
    lam = torch.exp(-LK_ETA * alpha)
    entry = lam * (ce + _p_logp(p, teacher_logp).sum(-1)) + (1.0 - lam) * (1.0 - alpha)
    if not grads:
        return entry, top, None
    mq = q * (q < p)
    tv_grad = -(mq - q * mq.sum(-1, keepdim=True))
    grad = (lam[..., None] * kl_grad + (1.0 - lam)[..., None] * tv_grad) * coef[..., None]
    return entry, top, grad.to(grad_dtype)


@cache
def _entry_fn(compiled: bool) -> Callable[..., Any]:
    # the chain of casts, exps and reductions over [chunk, V_draft] is memory-bound: compiled (GPU) it
    # fuses into a few kernels; eager it is what the CPU runs and the tests compare
    return torch.compile(entry_loss_and_grad, dynamic=True) if compiled else entry_loss_and_grad


@dataclass(frozen=True)
class HeadSpec:
    """What HeadLoss reads besides tensors: the teacher, where each step's entries find theirs and what they
    weigh, the loss kind and the teacher's truncation, the chunk size, whether gradients are wanted, and the
    dtype logits are made in."""

    targets: TTTTargets
    at: tuple[StepEntries, ...]
    coefs: tuple[torch.Tensor, ...]  # steps x [B, N] float32 (`_entry_weights`)
    kind: LossKind
    top_k: int | None  # `top_k_teacher`'s: None, the whole draft vocabulary
    chunk: int
    grads: bool
    dtype: torch.dtype


class HeadLoss(torch.autograd.Function):
    """sum_k sum(coef_k * entry loss) of logits = states[k] @ lm_head.T against each entry's teacher, with
    the per-entry losses [steps, B, N] and draft top ids [steps, B, N] (not differentiable) beside it.

    Computed chunk by chunk, with the gradients made in the same pass from each chunk's logits (the loss is
    linear in coef, and backward only scales them by the incoming gradient). A step's logit gradients
    [B * N, V] are gathered in the compute dtype (the size of the teacher's logits), so that its state's and
    lm_head's gradients are each one matrix product; lm_head's sums over the steps in float32.
    """

    @staticmethod
    def forward(
        ctx: Any, spec: HeadSpec, lm_head: torch.Tensor, *states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, h = states[0].shape
        device = states[0].device
        weight = lm_head.detach().to(spec.dtype)  # cast once for every step
        # float32 losses (float64 for a float64 check, so that it compares exactly)
        per_entry = torch.zeros(
            len(states), b * n, dtype=torch.promote_types(spec.dtype, torch.float32), device=device
        )
        top = torch.zeros(len(states), b * n, dtype=torch.long, device=device)
        grad_states = []
        grad_head = torch.zeros(lm_head.shape, dtype=torch.float32, device=device) if spec.grads else None
        entry_fn = _entry_fn(states[0].is_cuda)
        with torch.autocast(device.type, enabled=False):
            for k, state in enumerate(states):
                x = state.reshape(b * n, h)
                where, coef = spec.at[k].teacher.reshape(-1), spec.coefs[k].reshape(-1)
                grad_logits = (  # [B * N, V]
                    torch.empty(b * n, weight.shape[0], dtype=spec.dtype, device=device)
                    if spec.grads
                    else None
                )
                for start in range(0, b * n, spec.chunk):
                    rows = slice(start, start + spec.chunk)
                    entry, best, grad = entry_fn(
                        *_teacher_rows(spec.targets, where[rows]),
                        x[rows] @ weight.T,
                        coef[rows],
                        spec.kind,
                        spec.top_k,
                        spec.grads,
                        spec.dtype,
                    )
                    per_entry[k, rows], top[k, rows] = entry, best
                    if grad_logits is not None:
                        grad_logits[rows] = grad
                if grad_logits is not None and grad_head is not None:
                    grad_states.append((grad_logits @ weight).view(b, n, h))
                    add_head_gradient(grad_head, grad_logits, x)
                del grad_logits
        total = (per_entry * torch.stack(spec.coefs).view(len(states), -1)).sum()
        if grad_head is not None:
            ctx.save_for_backward(grad_head, *grad_states)
        ctx.head_dtype = lm_head.dtype
        per_entry, top = per_entry.view(-1, b, n), top.view(-1, b, n)
        ctx.mark_non_differentiable(per_entry, top)
        return total, per_entry, top

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _entry: Any, _top: Any) -> tuple[Any, ...]:
        # scaled in place: a copy would add lm_head's float32 size and every step's state gradient to the
        # peak, at the start of backward, when all activations are still alive. A second backward through
        # the same graph is refused by autograd (the saved tensors' versions changed), never silently wrong.
        grad_head, *grad_states = ctx.saved_tensors
        head = grad_head.to(ctx.head_dtype)  # no copy when lm_head is float32, as the trainer keeps it
        return (
            None,
            head.mul_(grad_total.to(head.dtype)),
            *(g.mul_(grad_total.to(g.dtype)) for g in grad_states),
        )


def head_gradient_rows(hidden: int) -> int:
    """Rows of lm_head's gradient made at once: a float32 [rows, hidden] block of about 256 MiB."""
    return max(1, (1 << 26) // hidden)


def add_head_gradient(
    grad_head: torch.Tensor, grad_logits: torch.Tensor, x: torch.Tensor, rows: int | None = None
) -> None:
    """grad_head [V, H] float32 += grad_logits.T [V, m] @ x [m, H], `rows` rows at a time (default
    `head_gradient_rows`): the whole product in the compute dtype and its float32 copy would add 1.5 times
    lm_head's float32 size to the peak (6.6 GiB for a 163,840-token head at hidden 7168), with every
    activation alive."""
    rows = rows or head_gradient_rows(grad_head.shape[1])
    for start in range(0, grad_head.shape[0], rows):
        block = slice(start, start + rows)
        grad_head[block] += (grad_logits[:, block].T @ x).float()


def _teacher_rows(targets: TTTTargets, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's logits [m, V] and log-sum-exp [m] at flat rows `where` [m] of its [B * T] entries."""
    return (
        targets.teacher_logits.flatten(0, 1).index_select(0, where),
        targets.teacher_lse.flatten().index_select(0, where),
    )
