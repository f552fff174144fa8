import math

import torch

from eagle3_core.train.loss import TTTResult, ttt_loss


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
    result = ttt_loss([draft], target_logits, loss_mask, t2d)
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
    good, bad = ttt_loss(perfect, target_logits, loss_mask, t2d), ttt_loss(wrong, target_logits, loss_mask, t2d)
    assert good.acc == [1.0, 1.0] and good.full_acc == [1.0, 1.0]
    assert bad.acc[0] == 1.0 and bad.acc[1] == 0.0 and bad.full_acc[1] == 0.0
    assert bad.counted == [12, 10]  # 8 - 2 and 8 - 3 entries per sequence
    expected = bad.step_losses[0] + 0.8 * bad.step_losses[1]
    assert math.isclose(float(bad.loss), expected, rel_tol=1e-5)


def test_tau_is_one_plus_sum_of_running_products() -> None:
    r = TTTResult(torch.zeros(()), [0.0] * 3, [0.8, 0.5, 0.5], [0.0] * 3, [1] * 3)
    assert math.isclose(r.tau(1), 1.8)
    assert math.isclose(r.tau(3), 1 + 0.8 + 0.4 + 0.2)
