import math

import pytest
import torch
from pydantic import ValidationError

from eagle3_core.config import TrainConfig
from eagle3_core.train.loss import (
    LK_ETA,
    LossKind,
    TTTStats,
    add_head_gradient,
    chunked_ttt_targets,
    entry_loss,
    entry_loss_and_grad,
    lean_ttt_loss,
    ttt_loss,
    ttt_targets,
)


def test_alignment_masks_and_accuracy_on_a_hand_example() -> None:
    # target vocab 5, draft vocab = target ids {1, 2, 4}
    t2d = torch.tensor([False, True, True, False, True])
    target_logits = torch.full((1, 6, 5), -10.0)
    top = [1, 2, 4, 3, 1, 2]  # the target's argmax at each position; 3 is not draftable
    for p, tok in enumerate(top):
        target_logits[0, p, tok] = 10.0
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    # step 0, entry p predicts the target's top token at p+1, in draft ids: 2->1, 4->2, 1->0, 2->1
    draft = torch.full((1, 6, 3), -10.0)
    for p, draft_id in enumerate([1, 2, 0, 0, 1, 0]):  # entry 2 is wrong on purpose: 3 is not draftable
        draft[0, p, draft_id] = 10.0
    _, result = ttt_loss([draft], ttt_targets(target_logits, loss_mask, t2d, steps=1))
    # counted at step 0: entries p with loss_mask[p+2] = 1 and t2d[top[p+1]]: p=0 (top 2), p=1 (top 4),
    # p=2 (top 3: excluded), p=3 (top 1); p=4, 5 fall off the end.
    assert result.counted == [3]
    assert result.acc == [1.0]
    assert result.step_losses[0] < 1e-3


def test_step_weights_and_a_wrong_second_step() -> None:
    torch.manual_seed(0)
    t2d = torch.ones(7, dtype=torch.bool)
    target_logits = torch.randn(2, 8, 7)
    loss_mask = torch.ones(2, 8)
    perfect = [torch.roll(target_logits, -(k + 1), dims=1) * 50 for k in range(2)]
    wrong = [perfect[0], -perfect[1]]
    targets = ttt_targets(target_logits, loss_mask, t2d, steps=2)
    (_, good), (bad_loss, bad) = ttt_loss(perfect, targets), ttt_loss(wrong, targets)
    assert good.acc == [1.0, 1.0] and good.full_acc == [1.0, 1.0]
    assert bad.acc[0] == 1.0 and bad.acc[1] == 0.0 and bad.full_acc[1] == 0.0
    assert bad.counted == [12, 10]  # 8 - 2 and 8 - 3 entries per sequence
    expected = bad.step_losses[0] + 0.8 * bad.step_losses[1]
    assert math.isclose(float(bad_loss), expected, rel_tol=1e-5)


def test_stats_of_two_halves_add_up_to_the_whole_and_a_global_normaliser_splits_the_loss_exactly() -> None:
    torch.manual_seed(1)
    t2d = torch.rand(11) > 0.3
    target_logits = torch.randn(4, 9, 11)
    loss_mask = (torch.rand(4, 9) > 0.2).long()
    draft = [torch.randn(4, 9, int(t2d.sum())) for _ in range(3)]
    whole_targets = ttt_targets(target_logits, loss_mask, t2d, steps=3)
    whole_loss, whole = ttt_loss(draft, whole_targets)
    halves = [ttt_targets(target_logits[i : i + 2], loss_mask[i : i + 2], t2d, steps=3) for i in (0, 2)]
    norm = whole_targets.counts()
    parts = [
        ttt_loss([d[i : i + 2] for d in draft], h, normalizer=norm)
        for i, h in zip((0, 2), halves, strict=True)
    ]
    summed = (parts[0][1] + parts[1][1]).sums
    assert torch.equal(summed[1:], whole.sums[1:])  # counts add exactly
    torch.testing.assert_close(summed[0], whole.sums[0], rtol=1e-6, atol=1e-6)
    assert math.isclose(float(parts[0][0] + parts[1][0]), float(whole_loss), rel_tol=1e-6)


def test_tau_is_one_plus_sum_of_running_products() -> None:
    counted = torch.full((3,), 10.0, dtype=torch.float64)
    r = TTTStats(torch.stack([counted, torch.tensor([8.0, 5.0, 5.0], dtype=torch.float64), counted, counted]))
    assert math.isclose(r.tau(1), 1.8)
    assert math.isclose(r.tau(3), 1 + 0.8 + 0.4 + 0.2)


def _lean_case(seed: int, rows: int, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    target_vocab, hidden = 37, 16
    t2d = torch.rand(target_vocab, generator=g) > 0.3
    target_logits = 3 * torch.randn(rows, length, target_vocab, generator=g)
    loss_mask = (torch.rand(rows, length, generator=g) > 0.2).long()
    states = [torch.randn(rows, length, hidden, generator=g) for _ in range(3)]
    lm_head = torch.randn(int(t2d.sum()), hidden, generator=g) / hidden**0.5
    return t2d, target_logits, loss_mask, torch.stack(states), lm_head


@pytest.mark.parametrize("kind", ["kl", "lk_hybrid"])
@pytest.mark.parametrize(("rows", "length", "chunk"), [(5, 12, 30), (2, 40, 16), (3, 9, 10_000)])
def test_the_lean_loss_equals_the_plain_one_with_its_gradients(
    kind: LossKind, rows: int, length: int, chunk: int
) -> None:
    # chunks that span rows, chunks inside a row, and one chunk for everything
    t2d, target_logits, loss_mask, states, lm_head = _lean_case(3, rows, length)
    targets = ttt_targets(target_logits, loss_mask, t2d, steps=3)
    norm = targets.counts() * 2  # a global normaliser, as under DDP

    def run(lean: bool) -> tuple[torch.Tensor, TTTStats, torch.Tensor, torch.Tensor]:
        x, w = states.clone().requires_grad_(), lm_head.clone().requires_grad_()
        if lean:
            loss, stats = lean_ttt_loss(list(x), w, targets, 0.8, norm, kind, chunk_tokens=chunk)
        else:
            loss, stats = ttt_loss([s @ w.T for s in x], targets, 0.8, norm, kind)
        loss.backward()
        assert x.grad is not None and w.grad is not None
        return loss.detach(), stats, x.grad, w.grad

    (plain_loss, plain, plain_dx, plain_dw), (lean_loss, lean, lean_dx, lean_dw) = run(False), run(True)
    torch.testing.assert_close(lean_loss, plain_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(lean.sums[1:], plain.sums[1:])
    torch.testing.assert_close(lean.sums[0], plain.sums[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean_dx, plain_dx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(lean_dw, plain_dw, rtol=1e-4, atol=1e-6)
    assert float(plain_dw.abs().sum()) > 0


def test_the_lean_loss_scales_its_gradients_by_the_incoming_one_and_refuses_a_second_backward() -> None:
    # its backward scales the saved gradients in place (no copy at the peak): a scaled loss must still get
    # scaled gradients, and a second backward through the same graph must fail rather than scale twice
    t2d, target_logits, loss_mask, states, lm_head = _lean_case(5, 3, 10)
    targets = ttt_targets(target_logits, loss_mask, t2d, steps=3)

    def backward(scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, w = states.clone().requires_grad_(), lm_head.clone().requires_grad_()
        loss, _ = lean_ttt_loss(list(x), w, targets, chunk_tokens=8)
        (scale * loss).backward(retain_graph=True)
        assert x.grad is not None and w.grad is not None
        return x.grad, w.grad, loss

    dx, dw, _ = backward(1.0)
    scaled_dx, scaled_dw, loss = backward(2.5)
    torch.testing.assert_close(scaled_dx, 2.5 * dx)
    torch.testing.assert_close(scaled_dw, 2.5 * dw)
    assert float(dw.abs().sum()) > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("rows", [1, 4, 7, 64])
def test_lm_heads_gradient_made_a_block_of_rows_at_a_time_is_the_whole_product(rows: int) -> None:
    g = torch.Generator().manual_seed(6)
    grad_logits = torch.randn(50, 23, generator=g).bfloat16()  # [entries, V_draft], the compute dtype
    x = torch.randn(50, 16, generator=g).bfloat16()  # [entries, H]
    start = torch.randn(23, 16, generator=g)  # what earlier steps summed
    got = start.clone()
    add_head_gradient(got, grad_logits, x, rows)
    torch.testing.assert_close(got, start + (grad_logits.T @ x).float(), rtol=0, atol=0)


def test_the_lean_loss_in_bf16_matches_the_plain_one_under_autocast() -> None:
    t2d, target_logits, loss_mask, states, lm_head = _lean_case(4, 4, 20)
    targets = ttt_targets(target_logits.bfloat16(), loss_mask, t2d, steps=3)
    x, w = states.clone().requires_grad_(), lm_head.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_loss, plain = ttt_loss([torch.nn.functional.linear(s, w) for s in x], targets)
    plain_loss.backward()
    assert x.grad is not None and w.grad is not None
    plain_dx, plain_dw = x.grad.clone(), w.grad.clone()
    x.grad, w.grad = None, None
    lean_loss, lean = lean_ttt_loss(list(x), w, targets, compute_dtype=torch.bfloat16, chunk_tokens=16)
    lean_loss.backward()
    torch.testing.assert_close(lean_loss, plain_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(lean.sums[1:], plain.sums[1:])
    # the state's gradient is the same bf16 product of the step's whole logit gradients in both forms
    torch.testing.assert_close(x.grad, plain_dx, rtol=1e-3, atol=1e-4 * float(plain_dx.abs().max()))
    # lm_head's: the plain form adds the steps' bf16 products in bf16 (autocast's one cast of the weight),
    # the lean one in float32; both within bf16's 3 significant digits of the gradient's scale
    torch.testing.assert_close(w.grad, plain_dw, rtol=2e-2, atol=8e-3 * float(plain_dw.abs().max()))


def test_the_chunked_teacher_equals_the_whole_one() -> None:
    t2d, target_logits, loss_mask, _, _ = _lean_case(5, 3, 11)
    hidden = torch.randn(3, 11, 8)
    head = torch.randn(target_logits.shape[-1], 8)
    whole = ttt_targets(hidden @ head.T, loss_mask, t2d, steps=3)
    chunked = chunked_ttt_targets(lambda h: h @ head.T, hidden, loss_mask, t2d, steps=3, chunk_tokens=7)
    for name in ("teacher_logits", "teacher_lse", "teacher_top", "masks"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name))
    torch.testing.assert_close(whole.logp(), torch.log_softmax((hidden @ head.T)[..., t2d], -1))


def _both_forms(
    kind: LossKind, top_k: int | None, target_logits: torch.Tensor, dtype: torch.dtype = torch.float64
) -> list[tuple[torch.Tensor, TTTStats, torch.Tensor, torch.Tensor]]:
    """(loss, stats, d states, d lm_head) of the plain and the lean form on `_lean_case(7, 4, 15)` with these
    target logits, states and lm_head in `dtype`."""
    t2d, _, loss_mask, states, lm_head = _lean_case(7, 4, 15)
    targets = ttt_targets(target_logits, loss_mask, t2d, steps=3)
    out = []
    for lean in (False, True):
        x, w = states.to(dtype).requires_grad_(), lm_head.to(dtype).requires_grad_()
        if lean:
            loss, stats = lean_ttt_loss(
                list(x), w, targets, 0.8, None, kind, dtype, chunk_tokens=13, teacher_top_k=top_k
            )
        else:
            loss, stats = ttt_loss([s @ w.T for s in x], targets, 0.8, None, kind, teacher_top_k=top_k)
        loss.backward()
        assert x.grad is not None and w.grad is not None
        out.append((loss.detach(), stats, x.grad, w.grad))
    return out


@pytest.mark.parametrize("kind", ["kl", "lk_hybrid"])
@pytest.mark.parametrize("top_k", [1, 4, 10])
def test_top_k_distillation_in_the_lean_form_equals_the_plain_one_with_its_gradients(
    kind: LossKind, top_k: int
) -> None:
    (plain_loss, plain, plain_dx, plain_dw), (lean_loss, lean, lean_dx, lean_dw) = _both_forms(
        kind, top_k, _lean_case(7, 4, 15)[1]
    )
    # the plain form sums its total in float32, the lean one in the compute dtype
    torch.testing.assert_close(lean_loss, plain_loss.double(), rtol=1e-6, atol=1e-7)
    assert torch.equal(lean.sums[1:], plain.sums[1:])  # the accuracy statistics do not see the truncation
    torch.testing.assert_close(lean.sums[0], plain.sums[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lean_dx, plain_dx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lean_dw, plain_dw, rtol=1e-5, atol=1e-7)
    assert float(plain_dw.abs().sum()) > 0
    # and it is a different loss from the untruncated one, with the same accuracy statistics
    (whole_loss, whole, _, _), _ = _both_forms(kind, None, _lean_case(7, 4, 15)[1])
    assert not torch.isclose(plain_loss, whole_loss)
    assert torch.equal(whole.sums[1:], plain.sums[1:])


@pytest.mark.parametrize("kind", ["kl", "lk_hybrid"])
def test_top_k_at_or_past_the_draft_vocabulary_is_the_untruncated_loss_exactly(kind: LossKind) -> None:
    target_logits = _lean_case(7, 4, 15)[1]
    vocab = int(_lean_case(7, 4, 15)[0].sum())
    untruncated = _both_forms(kind, None, target_logits)
    for top_k in (vocab, vocab + 1, 10 * vocab):
        for got, want in zip(_both_forms(kind, top_k, target_logits), untruncated, strict=True):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1].sums, want[1].sums)
            assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


@pytest.mark.parametrize("kind", ["kl", "lk_hybrid"])
def test_top_k_distillation_on_a_hand_example(kind: LossKind) -> None:
    # vocab 5, K 2: S = {3, 0} (teacher logits 3 and 2); p renormalised over S; q over all 5 ids
    teacher = [2.0, 1.0, 0.0, 3.0, -1.0]
    draft = [0.0, 1.0, 2.0, 0.5, -1.0]
    p = {3: 1 / (1 + math.exp(-1.0)), 0: 1 / (1 + math.exp(1.0))}
    q = [math.exp(z) / sum(math.exp(d) for d in draft) for z in draft]
    ce = -sum(p_i * math.log(q[i]) for i, p_i in p.items())
    alpha = sum(min(p_i, q[i]) for i, p_i in p.items())
    kl = sum(p_i * math.log(p_i / q[i]) for i, p_i in p.items())
    lam = math.exp(-LK_ETA * alpha)
    want = ce if kind == "kl" else lam * kl + (1 - lam) * (1 - alpha)

    logits = torch.tensor([teacher], dtype=torch.float64)
    lse = torch.logsumexp(logits, -1)
    z = torch.tensor([draft], dtype=torch.float64, requires_grad=True)
    plain = entry_loss(logits - lse[:, None], z, kind, top_k=2)
    lean, _, grad = entry_loss_and_grad(logits, lse, z.detach(), torch.ones(1), kind, 2, True, torch.float64)
    assert math.isclose(float(plain.detach()), want, rel_tol=1e-6)
    assert math.isclose(float(lean), want, rel_tol=1e-6)
    plain.sum().backward()
    assert z.grad is not None and grad is not None
    torch.testing.assert_close(grad, z.grad, rtol=1e-6, atol=1e-7)
    if kind == "kl":  # d/dz = q - p, p zero outside S
        want_grad = [q[i] - p.get(i, 0.0) for i in range(5)]
        torch.testing.assert_close(
            grad[0], torch.tensor(want_grad, dtype=torch.float64), rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("kind", ["kl", "lk_hybrid"])
@pytest.mark.parametrize("top_k", [None, 1, 3, 20])
def test_no_nan_with_minus_infinite_teacher_logits_or_a_single_top_id(
    kind: LossKind, top_k: int | None
) -> None:
    t2d, target_logits, _, _, _ = _lean_case(7, 4, 15)
    target_logits = target_logits.clone()
    # a third of the vocabulary never comes (fewer than 20 draft ids left), and in the first row only one
    # draft id has any mass (a row with none has no teacher at all: its log-sum-exp is -inf)
    target_logits[..., ::3] = float("-inf")
    only = int(t2d.nonzero()[1])
    target_logits[0, :, torch.arange(target_logits.shape[-1]) != only] = float("-inf")
    forms = _both_forms(kind, top_k, target_logits, torch.float32)
    for loss, stats, dx, dw in forms:
        assert torch.isfinite(loss) and torch.isfinite(stats.sums).all()
        assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    torch.testing.assert_close(forms[1][0], forms[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(forms[1][3], forms[0][3], rtol=1e-4, atol=1e-6)


def test_the_teacher_top_k_setting_validates() -> None:
    assert TrainConfig().teacher_top_k is None
    assert TrainConfig(teacher_top_k=10).teacher_top_k == 10
    for bad in (0, -1):
        with pytest.raises(ValidationError, match="teacher_top_k"):
            TrainConfig(teacher_top_k=bad)
