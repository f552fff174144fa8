"""train/selection.py: which measured step's weights a run keeps, from rounds constructed here (a scripted
probe), and what a resumed run takes up of a choice made before it was cut short."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.config import TrainConfig
from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.evaluate.measure import PathTiming, PromptRun
from eagle3_core.evaluate.selection import BEST_ROUNDS, BEST_WEIGHTS, ALSelector
from eagle3_core.store.records import KeptRounds
from eagle3_core.train.run_dir import drafter_state
from eagle3_core.train.selection import BEST

K = 3
PROMPTS = 12


class ScriptedProbe:
    """Returns, call by call, rounds that accept `accepted` drafts each (4 rounds a prompt)."""

    k, prompts, fingerprint = K, PROMPTS, "scripted"

    def __init__(self, *accepted: list[int], further: dict[float, list[int]] | None = None) -> None:
        self.script = list(accepted)
        self.calls = 0
        self.further = further or {}  # the further prompts' rounds, by the drafter's weights (its fill)
        self.confirm_prompts = len(next(iter(self.further.values()), []))
        self.confirmed: list[float] = []

    delay = 0.0  # seconds a measurement takes

    def measure(self, drafter: Eagle3Drafter) -> list[PromptRun]:
        time.sleep(self.delay)
        per_prompt = self.script[self.calls]
        self.calls += 1
        return _runs(per_prompt)

    def confirm(self, drafter: Eagle3Drafter) -> list[PromptRun]:
        fill = round(drafter.fc.weight.flatten()[0].item(), 4)  # which step's weights it was given
        self.confirmed.append(fill)
        return _runs(self.further[fill])


def _runs(per_prompt: list[int]) -> list[PromptRun]:
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


def _measure_all(selector: ALSelector, steps: tuple[int, ...]) -> dict[int, dict[str, torch.Tensor]]:
    """Each step's drafter (weights filled with step / 100) measured in turn; their weights by step."""
    weights = {}
    for step in steps:
        drafter = _drafter(step / 100)
        weights[step] = drafter_state(drafter)
        row = selector.measure(drafter, step)
        assert row.k == K and row.prompts == PROMPTS and row.step == step
    return weights


def test_the_last_step_is_kept_unless_the_best_measured_beats_it_beyond_noise(tmp_path: Path) -> None:
    # a curve that rises, then dips within noise: the last step is kept, the best measured one stays in best/
    plateau = ScriptedProbe(
        [1] * PROMPTS,  # step 10: AL 2
        [3] * PROMPTS,  # step 20: AL 4, the best
        _mixed(3, 2, 11),  # step 30 (last): AL 3.92, lower on one prompt of 12: within noise
    )
    selector = _selector(plateau, tmp_path / "plateau")
    _measure_all(selector, (10, 20, 30))
    assert selector.best is not None and selector.best.step == 20
    assert (tmp_path / "plateau" / BEST / "drafter.safetensors").exists()
    assert selector.kept_weights() is None  # the last step's weights, as trained
    chosen = selector.selection([10, 20, 30])
    assert chosen is not None and (chosen.kept_step, chosen.last_step) == (30, 30) and chosen.difference == 0

    # a curve that falls beyond noise: the best measured step is kept, and the rows say so as it happens
    falling = ScriptedProbe([1] * PROMPTS, [3] * PROMPTS, [0] * PROMPTS)
    rows_kept: list[int] = []
    selector = _selector(falling, tmp_path / "falling")
    weights = {}
    for step in (10, 20, 30):
        drafter = _drafter(step / 100)
        weights[step] = drafter_state(drafter)
        rows_kept.append(selector.measure(drafter, step).best_step)
    assert rows_kept == [10, 20, 20]
    kept = selector.kept_weights()
    assert kept is not None and all(torch.equal(kept[n], weights[20][n]) for n in kept)
    chosen = selector.selection([10, 20, 30])
    assert chosen is not None
    assert (chosen.kept_step, chosen.last_step, chosen.kept_al, chosen.last_al) == (20, 30, 4.0, 1.0)
    assert chosen.difference == pytest.approx(3.0) and chosen.difference_ci95[0] > 0


def test_a_slowly_rising_curve_keeps_its_last_step_not_an_early_one(tmp_path: Path) -> None:
    """What the H200 run of bench/al_selection.py showed: no later step beats step 20 beyond noise, yet the
    last is the best; a rule that waits for a later step to be better beyond noise would have kept step 20."""
    rising = ScriptedProbe(
        [2] * PROMPTS,  # step 20: AL 3
        _mixed(3, 2, 2),  # step 40: AL 3.17
        _mixed(3, 2, 4),  # step 60: AL 3.33
        _mixed(3, 2, 6),  # step 80 (last): AL 3.5
    )
    selector = _selector(rising, tmp_path)
    _measure_all(selector, (20, 40, 60, 80))
    chosen = selector.selection([20, 40, 60, 80])
    assert chosen is not None and chosen.kept_step == 80 and selector.kept_weights() is None


def test_keep_last_measures_but_keeps_nothing_aside(tmp_path: Path) -> None:
    falling = ScriptedProbe([3] * PROMPTS, [0] * PROMPTS)
    selector = _selector(falling, tmp_path, keep="last")
    _measure_all(selector, (10, 20))
    assert selector.kept_weights() is None and selector.selection([10, 20]) is None
    assert not (tmp_path / BEST).exists()


def _resumed_at_50(logged: list[str]) -> ALSelector:
    """A selector of a run resumed at step 50 of 100 that has measured once since, for 2 s."""
    selector = ALSelector(ScriptedProbe(), TrainConfig(al_every=10, al_overhead=0.1), logged.append)
    selector.start_step, selector.spent, selector.latest_cost = 50, 2.0, 2.0
    return selector


def test_measurements_are_taken_while_they_and_the_last_one_fit_in_the_overhead_budget() -> None:
    logged: list[str] = []
    selector = ALSelector(ScriptedProbe(), TrainConfig(al_every=10, al_overhead=0.1), logged.append)
    assert not selector.due(15, 100, elapsed=15.0)  # not a multiple of al_every
    assert selector.due(10, 100, elapsed=10.0)  # the first: nothing tells yet what one costs
    # 2 s spent on one measurement, 20 s of training for 20 of 100 steps: 100 s projected, 10 s to measure in
    selector.spent = selector.latest_cost = 2.0
    assert selector.due(20, 100, elapsed=22.0)  # 2 + 2 for this one + 2 for the last step's = 6 s
    selector.spent = 8.0  # 8 + 2 + 2 = 12 s: over
    assert not selector.due(30, 100, elapsed=38.0)
    assert "over train.al_overhead 0.1 with the last step's still to come" in logged[-1]
    assert selector.due(100, 100, elapsed=108.0)  # the last step is always measured
    # a run resumed at step 50 projects from the steps this process trained: 10 s for 10 of its 50 steps
    assert not _resumed_at_50(logged).due(60, 100, elapsed=12.0)  # 50 s projected: 5 s budget, 6 needed
    assert _resumed_at_50(logged).due(60, 100, elapsed=14.0)  # 12 s for 10 steps: 60 s projected, 6 s needed
    unbounded = ALSelector(ScriptedProbe(), TrainConfig(al_every=10, al_overhead=None), logged.append)
    unbounded.spent = unbounded.latest_cost = 1000.0
    assert unbounded.due(20, 100, elapsed=1010.0)


def test_the_budget_projects_the_steps_left_at_the_rate_since_the_last_due_step() -> None:
    """A slow start (the first steps compile) is paid once: projected at the run's mean rate, it would leave
    room for measurements the run's real training time has not."""
    logged: list[str] = []
    selector = ALSelector(ScriptedProbe(), TrainConfig(al_every=10, al_overhead=0.1), logged.append)
    assert selector.due(10, 100, elapsed=50.0)  # the first 10 steps took 50 s
    selector.spent = selector.latest_cost = 2.0
    assert selector.due(20, 100, elapsed=62.0)  # 1 s a step since: 60 + 80 = 140 s projected, 6 s needed
    assert selector.projected == 140.0
    selector.spent = 11.0  # 11 + 2 + 2 = 15 s against 14 (at the mean rate, 70 of 30 steps: 23 s)
    assert not selector.due(30, 100, elapsed=81.0)
    assert selector.projected == 140.0 and "over train.al_overhead" in logged[-1]
    assert selector.due(100, 100, elapsed=151.0) and selector.projected == 140.0  # at the end: as trained


def test_a_resumed_run_takes_up_the_kept_weights_chosen_before_its_checkpoint(tmp_path: Path) -> None:
    first = _selector(ScriptedProbe([2] * PROMPTS, [0] * PROMPTS), tmp_path)
    first.measure(_drafter(0.1), 10)
    first.measure(_drafter(0.2), 20)
    assert first.best is not None and first.best.step == 10

    resumed = ALSelector(ScriptedProbe([0] * PROMPTS), TrainConfig(al_overhead=None), lambda _: None)
    resumed.resume(tmp_path, 10)  # the checkpoint of step 10: the choice made at step 10 stands
    assert resumed.best is not None and resumed.best.step == 10
    assert [r.accepted for r in resumed.best.runs] == [(2,) * 4] * PROMPTS
    resumed.measure(_drafter(0.3), 20)  # worse beyond noise than step 10, compared on its own rounds
    kept = resumed.kept_weights()
    assert kept is not None and torch.equal(kept["fc.weight"], torch.full_like(kept["fc.weight"], 0.1))

    earlier = ALSelector(ScriptedProbe(), TrainConfig(al_overhead=None), lambda _: None)
    earlier.resume(tmp_path, 0)  # resumed before step 10 was measured: that choice is dropped
    assert earlier.best is None and not (tmp_path / BEST).exists()


def test_a_run_resumed_from_any_checkpoint_chooses_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """What each checkpoint saved of the choice (`saved`, written inside it) is what a selector resumed from it
    takes up. Cut short after the last checkpoint, before final/: the same kept weights and selection as the
    run not cut short, over the further prompts its confirmation decoded, and nothing decoded again. Cut short
    after best/ moved to a step measured after the checkpoint: the best that checkpoint saw, best/ put back."""
    probe = ScriptedProbe(
        [1] * PROMPTS, [3] * PROMPTS, _mixed(3, 2, 11), further={0.2: [3] * 24, 0.3: [2] * 24}
    )
    run = _selector(probe, tmp_path, al_every=10)
    checkpoints = {}
    for step in (10, 20, 30):
        assert run.due(step, 30, 1.0)
        drafter = _drafter(step / 100)
        run.measure(drafter, step)
        checkpoints[step] = (run.saved(step), drafter_state(drafter))  # what the checkpoint of `step` holds
    chosen, kept = run.selection([10, 20, 30]), run.kept_weights()
    assert chosen is not None and chosen.kept_step == 20 and chosen.prompts == 36 and kept is not None
    assert set(checkpoints[30][0]) == {"selection.json", "selection.safetensors"}  # step 20's weights
    assert set(checkpoints[10][0]) == {"selection.json"}  # the best is the step's own: the checkpoint's

    untouched = ScriptedProbe()  # any decode would fail: it has no rounds to give
    resumed = ALSelector(untouched, TrainConfig(al_every=10, al_overhead=None), lambda _: None)
    resumed.resume(tmp_path, 30, *checkpoints[30])
    assert not resumed.end_due(30) and untouched.calls == 0
    assert resumed.selection([10, 20, 30]) == chosen
    resumed_kept = resumed.kept_weights()
    assert resumed_kept is not None and all(torch.equal(resumed_kept[n], kept[n]) for n in kept)

    earlier = ALSelector(ScriptedProbe(), TrainConfig(al_every=10, al_overhead=None), lambda _: None)
    earlier.resume(tmp_path, 10, *checkpoints[10])  # best/ holds step 20, measured after this checkpoint
    assert earlier.best is not None and earlier.best.step == 10
    assert KeptRounds.read(tmp_path / BEST / BEST_ROUNDS).step == 10
    again = load_file(str(tmp_path / BEST / BEST_WEIGHTS))
    assert all(torch.equal(again[n], checkpoints[10][1][n]) for n in again)

    legacy = ALSelector(ScriptedProbe(), TrainConfig(al_every=10, al_overhead=None), lambda _: None)
    legacy.resume(
        tmp_path, 30
    )  # a checkpoint an eagle3 that saved nothing wrote: the last step measured again
    assert legacy.end_due(30) and legacy.best is not None and legacy.best.step == 10


def test_kept_rounds_measured_on_other_prompts_are_not_compared(tmp_path: Path) -> None:
    _selector(ScriptedProbe([2] * PROMPTS), tmp_path).measure(_drafter(0.1), 10)
    other = ScriptedProbe()
    other.fingerprint = "other prompts"
    selector = ALSelector(other, TrainConfig(al_overhead=None), lambda _: None)
    selector.resume(tmp_path, 10)
    assert selector.best is None and not (tmp_path / BEST).exists()


@pytest.mark.parametrize(
    ("further_best", "kept"),
    [
        ([3] * 24, 20),  # on 24 more prompts the best measured step is better everywhere: it is kept
        ([2] * 24, 30),  # and where they are equal there, the last is
    ],
)
def test_a_lead_within_noise_is_decided_on_further_prompts_at_the_last_step(
    tmp_path: Path, further_best: list[int], kept: int
) -> None:
    """Step 20 leads the last on one prompt of 12 (within noise): at the last step both decode the probe's
    further prompts, given each step's own weights, and the choice is made on all 36."""
    probe = ScriptedProbe(
        [1] * PROMPTS, [3] * PROMPTS, _mixed(3, 2, 11), further={0.2: further_best, 0.3: [2] * 24}
    )
    selector = _selector(probe, tmp_path, al_every=10)
    for step in (10, 20, 30):
        assert selector.due(step, 30, 1.0)
        selector.measure(_drafter(step / 100), step)
    assert sorted(probe.confirmed) == [0.2, 0.3]  # best/'s weights and the last's
    chosen = selector.selection([10, 20, 30])
    assert chosen is not None and chosen.prompts == 36 and chosen.kept_step == kept
    assert (selector.kept_weights() is None) == (kept == 30)


def test_no_further_prompts_are_decoded_when_the_last_leads_or_the_best_is_already_beyond_noise(
    tmp_path: Path,
) -> None:
    further = {0.2: [3] * 24, 0.3: [3] * 24}
    for name, last in (("last leads", [3] * PROMPTS), ("beyond noise", [0] * PROMPTS)):
        probe = ScriptedProbe([1] * PROMPTS, _mixed(3, 2, 11), last, further=further)
        selector = _selector(probe, tmp_path / name.replace(" ", "_"), al_every=10)
        for step in (10, 20, 30):
            assert selector.due(step, 30, 1.0)
            selector.measure(_drafter(step / 100), step)
        assert probe.confirmed == [], name
        chosen = selector.selection([10, 20, 30])
        assert chosen is not None and chosen.prompts == PROMPTS, name


def test_further_prompts_that_would_break_the_overhead_budget_are_not_decoded(tmp_path: Path) -> None:
    """A lead within noise, but decoding 12,000 further prompts twice, at 0.05 s for 12, would take about
    100 s against 30 s of training (al_overhead 1.0): skipped, said, and the choice made on the probe's."""
    probe = ScriptedProbe(
        [1] * PROMPTS, [3] * PROMPTS, _mixed(3, 2, 11), further={0.2: [3] * 12000, 0.3: [3] * 12000}
    )
    probe.delay = 0.05
    said: list[str] = []
    selector = ALSelector(probe, TrainConfig(al_every=10, al_overhead=1.0), said.append)
    selector.resume(tmp_path, 0)
    for step in (10, 20, 30):
        assert selector.due(step, 30, selector.spent + step)  # a second of training a step
        selector.measure(_drafter(step / 100), step)
    assert probe.confirmed == []
    assert any("not decoded on 12000 more prompts" in line and "al_overhead 1.0" in line for line in said)
    chosen = selector.selection([10, 20, 30])
    assert chosen is not None and chosen.prompts == PROMPTS and chosen.kept_step == 30
