"""train/selection.py: which measured step's weights a run keeps, from rounds constructed here (a scripted
probe), and what a resumed run takes up of a choice made before it was cut short."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_core.config import TrainConfig
from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.evaluate.measure import PathTiming, PromptRun
from eagle3_core.evaluate.selection import ALSelector
from eagle3_core.train.run_dir import drafter_state
from eagle3_core.train.selection import BEST

K = 3
PROMPTS = 12


class ScriptedProbe:
    """Returns, call by call, rounds that accept `accepted` drafts each (4 rounds a prompt)."""

    k, prompts, fingerprint = K, PROMPTS, "scripted"

    def __init__(self, *accepted: list[int]) -> None:
        self.script = list(accepted)
        self.calls = 0

    def measure(self, drafter: Eagle3Drafter) -> list[PromptRun]:
        per_prompt = self.script[self.calls]
        self.calls += 1
        return [PromptRun((a,) * 4, PathTiming(), PathTiming()) for a in per_prompt]


def _drafter(fill: float) -> Eagle3Drafter:
    cfg = DrafterConfig(
        target_hidden_size=16, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
        target_vocab_size=64, draft_vocab_size=32,
    )  # fmt: skip
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.fill_(fill)
    return drafter


def _selector(probe: ScriptedProbe, run_dir: Path, **train: object) -> ALSelector:
    selector = ALSelector(probe, TrainConfig(al_overhead=None, **train), lambda _: None)
    selector.resume(run_dir, 0)
    return selector


def _mixed(high: int, low: int, n_high: int) -> list[int]:
    return [high] * n_high + [low] * (PROMPTS - n_high)


def test_a_later_step_replaces_the_kept_one_only_when_better_beyond_noise(tmp_path: Path) -> None:
    probe = ScriptedProbe(
        [1] * PROMPTS,  # step 10: AL 2
        _mixed(2, 1, 2),  # step 20: better on 2 prompts of 12, within noise: step 10 stays
        [3] * PROMPTS,  # step 30: better on every prompt: kept
        _mixed(3, 2, 11),  # step 40 (last): slightly worse, within noise: step 30 stays
    )
    selector = _selector(probe, tmp_path)
    weights = {}
    for step in (10, 20, 30, 40):
        drafter = _drafter(step / 100)
        weights[step] = drafter_state(drafter)
        row = selector.measure(drafter, step)
        assert row.k == K and row.prompts == PROMPTS
    assert selector.best is not None and selector.best.step == 30
    kept = selector.kept_weights()
    assert kept is not None and all(torch.equal(kept[n], weights[30][n]) for n in kept)
    chosen = selector.selection([10, 20, 30, 40])
    assert chosen is not None
    assert (chosen.kept_step, chosen.last_step, chosen.kept_al) == (30, 40, 4.0)
    assert chosen.difference == pytest.approx(4.0 - (1 + (3 * 11 + 2) / 12), abs=1e-4)
    assert chosen.difference_ci95[0] <= chosen.difference <= chosen.difference_ci95[1]
    # best/ holds the kept weights whole, beside the checkpoints
    assert (tmp_path / BEST / "drafter.safetensors").exists()


def test_the_last_step_is_the_run_s_result_when_it_is_the_kept_one_or_keep_is_last(tmp_path: Path) -> None:
    rising = ScriptedProbe([0] * PROMPTS, [3] * PROMPTS)
    selector = _selector(rising, tmp_path / "a")
    for step in (10, 20):
        selector.measure(_drafter(step), step)
    assert selector.kept_weights() is None  # the last step is the kept one: the trained weights as they are
    chosen = selector.selection([10, 20])
    assert chosen is not None and chosen.kept_step == chosen.last_step == 20 and chosen.difference == 0

    falling = ScriptedProbe([3] * PROMPTS, [0] * PROMPTS)
    last = _selector(falling, tmp_path / "b", keep="last")
    for step in (10, 20):
        last.measure(_drafter(step), step)
    assert last.kept_weights() is None and last.selection([10, 20]) is None
    assert not (tmp_path / "b" / BEST).exists()


def test_measurements_over_the_overhead_budget_are_skipped_but_never_the_last() -> None:
    logged: list[str] = []
    selector = ALSelector(ScriptedProbe(), TrainConfig(al_every=10, al_overhead=0.1), logged.append)
    assert not selector.due(15, last=False, elapsed=100.0)  # not a multiple of al_every
    assert selector.due(10, last=False, elapsed=100.0)
    selector.spent = 20.0  # 20 s measuring against 80 s training: over 10%
    assert not selector.due(20, last=False, elapsed=100.0)
    assert "over train.al_overhead 0.1" in logged[-1]
    assert selector.due(23, last=True, elapsed=100.0)
    selector.spent = 5.0  # 5 s against 95 s: under
    assert selector.due(30, last=False, elapsed=100.0)


def test_a_resumed_run_takes_up_the_kept_weights_chosen_before_its_checkpoint(tmp_path: Path) -> None:
    first = _selector(ScriptedProbe([2] * PROMPTS, [0] * PROMPTS), tmp_path)
    first.measure(_drafter(0.1), 10)
    first.measure(_drafter(0.2), 20)
    assert first.best is not None and first.best.step == 10

    resumed = ALSelector(ScriptedProbe([0] * PROMPTS), TrainConfig(al_overhead=None), lambda _: None)
    resumed.resume(tmp_path, 10)  # the checkpoint of step 10: the choice made at step 10 stands
    assert resumed.best is not None and resumed.best.step == 10
    assert [r.accepted for r in resumed.best.runs] == [(2,) * 4] * PROMPTS
    resumed.measure(_drafter(0.3), 20)  # worse than the kept one: step 10 stays, compared on its own rounds
    assert resumed.kept_weights() is not None

    earlier = ALSelector(ScriptedProbe(), TrainConfig(al_overhead=None), lambda _: None)
    earlier.resume(tmp_path, 0)  # resumed before step 10 was measured: that choice is dropped
    assert earlier.best is None and not (tmp_path / BEST).exists()


def test_kept_rounds_measured_on_other_prompts_are_not_compared(tmp_path: Path) -> None:
    _selector(ScriptedProbe([2] * PROMPTS), tmp_path).measure(_drafter(0.1), 10)
    other = ScriptedProbe()
    other.fingerprint = "other prompts"
    selector = ALSelector(other, TrainConfig(al_overhead=None), lambda _: None)
    selector.resume(tmp_path, 10)
    assert selector.best is None and not (tmp_path / BEST).exists()
