"""The training recipe's knobs: Muon beside AdamW as one optimizer, the schedules, the LK loss, the variants."""

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3_core.config import DrafterVariant, TrainConfig
from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.train.checkpoint import load_checkpoint, save_checkpoint
from eagle3_core.train.loss import entry_loss
from eagle3_core.train.muon import DistributedMuon, newton_schulz_work, owners
from eagle3_core.train.optim import Optimizers, build_optimizer, muon_split
from eagle3_core.train.schedule import learning_rate
from tests.fakes import tiny_drafter_config
from tests.records import run_progress

CFG = tiny_drafter_config(target_hidden_size=32, hidden_size=32, intermediate_size=64, draft_vocab_size=40)


def _drafter(seed: int = 0, **variant: object) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return Eagle3Drafter(CFG.model_copy(update=variant))


def _step(drafter: Eagle3Drafter, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 9, 3 * 32, generator=g)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    loss = sum(x.logsumexp(-1).mean() for x in drafter(aux, ids, 3))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_muon_takes_the_layer_matrices_and_adamw_the_head_norms_and_frozen_embedding() -> None:
    drafter = _drafter(norm_before_fc=True)
    muon, adamw = muon_split(drafter)
    names = {id(p): n for n, p in drafter.named_parameters()}
    assert {names[id(p)] for p in muon} == {
        "fc.weight",
        *(f"midlayer.self_attn.{x}_proj.weight" for x in "qkvo"),
        *(f"midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down")),
    }
    assert {names[id(p)] for p in adamw} == {
        "lm_head.weight",
        "input_norm.weight",
        "norm.weight",
        *(f"midlayer.{x}.weight" for x in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
    }  # the embedding is frozen: in neither


def test_the_muon_pair_resumes_from_a_checkpoint_exactly(tmp_path: Path) -> None:
    cfg = TrainConfig(optimizer="muon", lr=0.02)
    straight = _drafter()
    opt = build_optimizer(straight, cfg)
    assert isinstance(opt, Optimizers)
    for i in range(3):
        _step(straight, opt, i)

    resumed = _drafter()
    first = build_optimizer(resumed, cfg)
    _step(resumed, first, 0)
    path = save_checkpoint(
        tmp_path,
        1,
        {n: p.detach() for n, p in resumed.named_parameters()},
        first.state_dict(),
        run_progress(),
        keep=2,
    )
    ckpt = load_checkpoint(path)
    again = _drafter(seed=5)  # other weights: everything must come from the checkpoint
    again.load_state_dict({**again.state_dict(), **ckpt.weights})
    second = build_optimizer(again, cfg)
    second.load_state_dict(ckpt.optimizer)
    for i in (1, 2):
        _step(again, second, i)
    for (name, a), b in zip(straight.named_parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_one_learning_rate_reaches_both_optimizers() -> None:
    opt = build_optimizer(_drafter(), TrainConfig(optimizer="muon"))
    for group in opt.param_groups:
        group["lr"] = 0.123
    assert isinstance(opt, Optimizers)
    assert [g["lr"] for part in opt.parts for g in part.param_groups] == [0.123, 0.123]


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_schedules_warm_up_then_decay_to_zero(schedule: str) -> None:
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.1, schedule=schedule)  # type: ignore[arg-type]
    rates = [learning_rate(s, 100, cfg) for s in range(101)]
    assert rates[9] == pytest.approx(1.0) and rates[0] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(rates[10:])) and rates[100] == 0.0
    midpoint = rates[55]  # halfway through the decay
    assert midpoint == pytest.approx(0.5, abs=0.01)
    quarter = rates[10 + 90 // 4]
    assert quarter == pytest.approx(0.75 if schedule == "linear" else 0.854, abs=0.01)


def test_lk_hybrid_is_kl_far_off_and_total_variation_close_by() -> None:
    teacher = F.log_softmax(torch.tensor([[4.0, 0.0, 0.0, 0.0]]), -1)
    far = torch.tensor([[0.0, 6.0, 0.0, 0.0]])  # alpha small: lam near 1
    near = torch.tensor([[4.2, 0.0, 0.1, 0.0]])  # alpha near 1: lam = e^-3
    for logits in (far, near):
        q, p = logits.softmax(-1), teacher.exp()
        alpha = torch.minimum(p, q).sum(-1)
        kl = (p * (teacher - q.log())).sum(-1)
        lam = torch.exp(-3.0 * alpha)
        torch.testing.assert_close(
            entry_loss(teacher, logits, "lk_hybrid"), lam * kl + (1 - lam) * (1 - alpha)
        )
    assert float(torch.exp(-3.0 * torch.minimum(teacher.exp(), far.softmax(-1)).sum())) > 0.8
    # kl is the soft cross-entropy: KL plus the teacher's entropy
    entropy = -(teacher.exp() * teacher).sum(-1)
    kl_far = (teacher.exp() * (teacher - far.log_softmax(-1))).sum(-1)
    torch.testing.assert_close(entry_loss(teacher, far, "kl"), kl_far + entropy)


def test_lk_gradient_moves_the_draft_towards_the_teacher() -> None:
    teacher = F.log_softmax(torch.tensor([[3.0, 1.0, 0.0]]), -1)
    logits = torch.tensor([[0.0, 2.0, 0.0]], requires_grad=True)
    entry_loss(teacher, logits, "lk_hybrid").sum().backward()
    assert logits.grad is not None and logits.grad[0, 0] < 0 < logits.grad[0, 1]


def test_the_variant_exclusion_is_refused_in_the_config() -> None:
    with pytest.raises(ValueError, match="exclusive"):
        DrafterVariant(norm_before_fc=True, fc_norm=True)
    with pytest.raises(ValueError, match="exclusive"):
        DrafterConfig(**{**CFG.model_dump(), "norm_before_fc": True, "fc_norm": True})


def _kimi_muon_shapes() -> list[torch.Size]:
    """The matrices Muon updates in the drafter eagle3 makes for Kimi-K2.5 (hidden 7168, 56 heads of 128, 8 key/
    value heads, intermediate 18,432): fc, q, k, v, o, gate, up, down."""
    h, i, kv = 7168, 18432, 8 * 128
    return [
        torch.Size(s)
        for s in ((h, 3 * h), (h, 2 * h), (kv, 2 * h), (kv, 2 * h), (h, h), (i, h), (i, h), (h, i))
    ]


def test_each_matrix_has_one_owner_and_the_orthogonalisation_work_is_shared_out() -> None:
    """At Kimi's widths the largest rank's share of the Newton-Schulz work is as small as any assignment of
    whole matrices to ranks makes it (found by trying every one)."""
    shapes = _kimi_muon_shapes()
    work = [newton_schulz_work(s) for s in shapes]

    def largest_share(owner: Sequence[int], ranks: int) -> int:
        return max(sum(w for w, o in zip(work, owner, strict=True) if o == r) for r in range(ranks))

    assert owners(shapes, 1) == [0] * len(shapes)
    assert sorted(owners(shapes, 8)) == list(range(8))  # one matrix each
    for ranks in (2, 3, 4):
        best = min(largest_share(a, ranks) for a in itertools.product(range(ranks), repeat=len(shapes)))
        assert largest_share(owners(shapes, ranks), ranks) == best, ranks
    assert largest_share(owners(shapes, 2), 2) < 0.52 * sum(work)


@pytest.mark.parametrize("settings", [{"adjust_lr_fn": "match_rms_adamw"}, {"nesterov": False}])
def test_on_one_process_distributed_muon_is_torchs_muon_bit_for_bit(settings: dict[str, object]) -> None:
    """Its own Newton-Schulz and learning-rate adjustment against torch.optim.Muon's, both branches of each."""
    ours, torchs = _drafter(), _drafter()
    ours_opt = DistributedMuon(muon_split(ours)[0], lr=0.02, **settings)  # type: ignore[arg-type]
    torch_opt = torch.optim.Muon(muon_split(torchs)[0], lr=0.02, **settings)  # type: ignore[arg-type]
    for i in range(3):
        _step(ours, ours_opt, i)
        _step(torchs, torch_opt, i)
    assert ours_opt.orthogonalised_here == 3 * len(muon_split(ours)[0])
    assert (
        ours_opt.step(lambda: torch.tensor(7.0)) == 7.0
    )  # a closure's loss, as torch's optimizers return it
    for (name, a), b in zip(ours.named_parameters(), torchs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
