import math

import torch

from eagle3_core.train.loss import TTTStats, ttt_loss, ttt_targets


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
