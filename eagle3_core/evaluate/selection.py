"""The weights a run keeps, chosen by what they accept: acceptance length measured during training.

Loss and teacher-forced accuracy keep improving after the acceptance length has peaked, so every
`train.al_every` steps (and at the last) the drafter as it stands decodes a fixed set of held-out prompts by
real speculative decoding (an `ALProbe`, built by the step that starts training: it holds the target). Each
measurement is a metric log row (`ALRow`). Under `train.keep: best_al` the run ends with the last step's
weights unless the best measured step beats the last beyond noise: the lower end of the paired 95% interval
of AL(best) - AL(last), over the same prompts, above 0 (the promotion gate's comparison). The last step is
the default because it has trained longest: on a curve that still rises slowly, keeping an earlier step until
a later one is better beyond noise sticks to the early step (on the H200, bench/results/al_selection_gpu.json:
step 120 of 320 kept, and the last step better by 0.065 on further prompts). The best measured weights and
their rounds live in `best/` beside the checkpoints (whole or absent), and every checkpoint keeps what the
choice stood on at its step (`saved`: the best and the latest measured steps' rounds, the best's weights), so
a run resumed from any checkpoint, its last one too (cut short before `final/`), chooses as it would have.

The measurements are bounded in time by `train.al_overhead` of the training time projected for the whole
run (the steps left at the rate since the latest due step, not at a mean that carries the first steps'
compilation): the first is taken when it falls due (it also loads the target, so it tells what one costs);
after it, a due measurement is taken only when it and the last step's, at the latest one's cost, still fit
in the budget (skips are logged). The last step is always measured. At the last step, a best measured step
that leads the last within noise is decoded with it on `train.al_confirm_prompts` further prompts, the
choice then made over all of them, when that still fits in the same budget.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from eagle3_core.config import TrainConfig
from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.acceptance import acceptance
from eagle3_core.evaluate.measure import (
    PathTiming,
    PromptRun,
    bootstrap_al_interval,
    paired_al_difference,
    pooled_runs_al,
)
from eagle3_core.store.atomic import atomic_directory
from eagle3_core.store.records import ALRow, ALSelection, KeptRounds, SelectorState
from eagle3_core.train.checkpoint import Extra
from eagle3_core.train.run_dir import drafter_state, load_drafter_state
from eagle3_core.train.selection import BEST

BEST_WEIGHTS = "drafter.safetensors"
BEST_ROUNDS = "rounds.json"
SAVED_STATE = "selection.json"  # in each checkpoint: SelectorState
SAVED_WEIGHTS = "selection.safetensors"  # in each checkpoint whose step is not the best measured one

Log = Callable[[str], None]


class ALProbe(Protocol):
    """Decodes the held-out prompts with a drafter at draft length `k`; one PromptRun per prompt, in order.
    `fingerprint` names the prompts and decode settings, so that rounds measured otherwise are never compared."""

    k: int
    prompts: int
    fingerprint: str
    confirm_prompts: int  # further prompts `confirm` decodes (0: none)

    def measure(self, drafter: Eagle3Drafter) -> list[PromptRun]: ...

    def confirm(self, drafter: Eagle3Drafter) -> list[PromptRun]:
        """The drafter on the further prompts, decoded as `measure` decodes its own."""
        ...


@dataclass
class Measured:
    step: int
    runs: list[PromptRun]


class ALSelector:
    """Measures the drafter on its steps and remembers the best measured weights (on rank 0 only): the
    trainer's `RunSelector` (train/selection.py)."""

    def __init__(self, probe: ALProbe, cfg: TrainConfig, log: Log) -> None:
        self.probe, self.cfg, self.log = probe, cfg, log
        self.best_dir = Path(BEST)  # under the run directory, once `resume` binds it
        self.best: Measured | None = None  # the highest AL measured (the later step on a tie)
        self.best_weights: dict[str, torch.Tensor] | None = None
        self.last: Measured | None = None
        self.start_step = 0  # the step this process started training from
        self.spent = 0.0  # seconds measuring, in this process
        self.latest_cost = 0.0  # seconds the latest measurement took
        self.total: int | None = None  # the run's last step, once `due` has been asked
        self.projected: float | None = None  # seconds of training projected for the run, at the latest `due`
        self.rate_mark: tuple[int, float] | None = None  # (step, seconds of training) at the latest due step

    # ---- when -----------------------------------------------------------------------------------------------
    def due(self, step: int, total: int, elapsed: float) -> bool:
        """Whether to measure at `step` of `total`; `elapsed`: seconds since training started in this process."""
        every, self.total = self.cfg.al_every, total
        training = max(elapsed - self.spent, 1e-9)
        projected = self.projected = self._projected_training(step, total, training)
        if step == total:
            return True
        if every is None or step % every:
            return False
        self.rate_mark = (step, training)
        if self.cfg.al_overhead is None or self.latest_cost == 0.0:
            return True
        needed = self.spent + 2 * self.latest_cost  # this measurement and the last step's
        if needed > self.cfg.al_overhead * projected:
            self.log(
                f"step {step}: acceptance length not measured (measuring took {self.spent:.0f} s so far, "
                f"{self.latest_cost:.0f} s the latest, against {projected:.0f} s of training projected for the "
                f"run: over train.al_overhead {self.cfg.al_overhead} with the last step's still to come)"
            )
            return False
        return True

    def _projected_training(self, step: int, total: int, training: float) -> float:
        """Seconds of training projected for the run: those so far, and the steps left at the rate since the
        latest due step (or since this process started, before one). Not the run's mean rate: the first steps
        compile, a cost paid once (on the H200 the SmolLM2 headline run took 178 s for its first 200 steps and
        32-39 s for each 200 after), and a mean that carries it overstates the time left."""
        since_step, since_training = self.rate_mark or (self.start_step, 0.0)
        per_step = (training - since_training) / max(step - since_step, 1)
        return training + (total - step) * per_step

    # ---- measuring ------------------------------------------------------------------------------------------
    def measure(self, drafter: Eagle3Drafter, step: int) -> ALRow:
        """The drafter's AL now; best/ moves here when it is the highest measured (train.keep best_al)."""
        started = time.perf_counter()
        runs = self.probe.measure(drafter)
        seconds = time.perf_counter() - started
        self.spent += seconds
        self.latest_cost = seconds
        self.last = Measured(step, runs)
        k = self.probe.k
        if self.cfg.keep == "best_al" and (
            self.best is None or pooled_runs_al(runs, k) >= pooled_runs_al(self.best.runs, k)
        ):
            self._keep(drafter, self.last)
        a = acceptance((x for r in runs for x in r.accepted), k)
        if step == self.total:
            self._confirm(drafter)
        kept_step = self._kept().step
        self.log(
            f"step {step}: AL {a.acceptance_length:.3f} at K={k} on {len(runs)} held-out prompts "
            f"({seconds:.1f} s); the run would keep step {kept_step}"
        )
        return ALRow(
            step=step,
            k=k,
            al=round(a.acceptance_length, 4),
            al_ci95=[round(x, 4) for x in bootstrap_al_interval(runs)],
            per_position=[round(x, 4) for x in a.per_position],
            prompts=len(runs),
            seconds=round(seconds, 2),
            best_step=kept_step,
        )

    def _kept(self) -> Measured:
        """What the run would end with now: the best measured step when it beats the latest beyond noise,
        else the latest (measured) step."""
        assert self.last is not None
        best, last = self.best, self.last
        if self.cfg.keep != "best_al" or best is None or best.step == last.step:
            return last
        low, _ = paired_al_difference(best.runs, last.runs).ci95
        return best if low > 0 else last

    def _confirm(self, last_drafter: Eagle3Drafter) -> None:
        """At the last step, when the best measured step leads the last but not beyond noise: both decoded on
        the probe's further prompts, and each one's rounds extended by them, so that the choice is made over
        all the prompts (a small decline hides in a few prompts' noise)."""
        best, last, k = self.best, self.last, self.probe.k
        if best is None or last is None or best.step == last.step or self.best_weights is None:
            return
        if self.probe.confirm_prompts == 0 or pooled_runs_al(best.runs, k) <= pooled_runs_al(last.runs, k):
            return
        if paired_al_difference(best.runs, last.runs).ci95[0] > 0:
            return
        cost = 2 * self.latest_cost * self.probe.confirm_prompts / max(len(last.runs), 1)  # as measured
        budget = self.cfg.al_overhead
        if budget is not None and self.projected is not None and self.spent + cost > budget * self.projected:
            self.log(
                f"step {best.step} led the last step within noise; not decoded on {self.probe.confirm_prompts} more "
                f"prompts: about {cost:.0f} s more would put measuring over train.al_overhead {budget}"
            )
            return
        started = time.perf_counter()
        # the best step's weights in a drafter of their own; its embedding stays unset: the probe puts in the target's
        best_drafter = Eagle3Drafter(last_drafter.cfg)
        load_drafter_state(best_drafter, self.best_weights, self.best_dir)
        self.best = Measured(best.step, best.runs + self.probe.confirm(best_drafter))
        self.last = Measured(last.step, last.runs + self.probe.confirm(last_drafter))
        seconds = time.perf_counter() - started
        self.spent += seconds
        self.log(
            f"step {best.step} led the last step within noise on {len(best.runs)} prompts: both decoded on "
            f"{self.probe.confirm_prompts} more ({seconds:.1f} s), the choice made on all of them"
        )

    def _keep(self, drafter: Eagle3Drafter, measured: Measured) -> None:
        """best/: the weights and rounds of `measured`, whole or absent (written before they are relied on)."""
        weights = {n: t.detach().cpu().clone().contiguous() for n, t in drafter_state(drafter).items()}
        self._write_best(weights, measured)
        self.best, self.best_weights = measured, weights

    def _write_best(self, weights: dict[str, torch.Tensor], measured: Measured) -> None:
        from safetensors.torch import save_file

        with atomic_directory(self.best_dir, replace=True) as temp:
            save_file(weights, str(temp / BEST_WEIGHTS))
            kept = [list(r.accepted) for r in measured.runs]
            KeptRounds(step=measured.step, probe=self.probe.fingerprint, accepted=kept).write(
                temp / BEST_ROUNDS
            )

    # ---- checkpoints, resume and the end ----------------------------------------------------------------------
    def saved(self, step: int) -> dict[str, Extra]:
        """What the checkpoint of `step` keeps of the choice (written inside it: train/checkpoint.py `extra`):
        the best and the latest measured steps' rounds, each with any further prompts' the confirmation decoded,
        and the best's weights unless they are the step's own (the checkpoint's)."""
        state = SelectorState(best=self._rounds(self.best), last=self._rounds(self.last))
        files: dict[str, Extra] = {SAVED_STATE: json.dumps(state.dump(), separators=(",", ":")).encode()}
        if self.best is not None and self.best.step != step:
            assert self.best_weights is not None  # set with best, always
            files[SAVED_WEIGHTS] = self.best_weights
        return files

    def _rounds(self, measured: Measured | None) -> KeptRounds | None:
        if measured is None:
            return None
        kept = [list(r.accepted) for r in measured.runs]
        return KeptRounds(step=measured.step, probe=self.probe.fingerprint, accepted=kept)

    def resume(
        self,
        run_dir: Path,
        step: int,
        saved: dict[str, Extra] | None = None,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Bind to `run_dir` and take up the choice a run cut short had made by `step`, the checkpoint resumed
        from: what that checkpoint `saved` (its own `weights` are the step's), else (a checkpoint of an eagle3
        that saved nothing) best/ when it was measured by then. What was measured after the checkpoint is
        dropped, as the steps are trained again."""
        self.best_dir, self.start_step = run_dir / BEST, step
        self.best = self.best_weights = self.last = None
        if saved is not None and SAVED_STATE in saved:
            self._take_up(saved, step, weights)
        else:
            self._take_up_best_dir(step)
        if self.best is not None:
            self.log(
                f"keeping step {self.best.step}'s weights so far (measured before the run was cut short)"
            )

    def _take_up(self, saved: dict[str, Extra], step: int, weights: dict[str, torch.Tensor] | None) -> None:
        """The choice as the checkpoint of `step` saved it; best/ made to hold its best again (a later best
        measured after the checkpoint was dropped)."""
        content = saved[SAVED_STATE]
        assert isinstance(content, bytes)  # written as bytes, verified by the checkpoint's load
        state = SelectorState.model_validate(json.loads(content))
        fingerprint = self.probe.fingerprint
        best, last = (
            r if r is not None and r.probe == fingerprint else None for r in (state.best, state.last)
        )
        best_weights = weights if best is not None and best.step == step else saved.get(SAVED_WEIGHTS)
        if best is not None and isinstance(best_weights, dict):
            self.best, self.best_weights = _measured(best), best_weights
            rounds = self.best_dir / BEST_ROUNDS
            held = KeptRounds.read(rounds) if rounds.exists() else None
            if held is None or (held.step, held.probe) != (best.step, best.probe):
                self._write_best(best_weights, self.best)
        else:
            shutil.rmtree(self.best_dir, ignore_errors=True)
        self.last = _measured(last) if last is not None else None

    def _take_up_best_dir(self, step: int) -> None:
        from safetensors.torch import load_file

        rounds = self.best_dir / BEST_ROUNDS
        if not rounds.exists():
            shutil.rmtree(self.best_dir, ignore_errors=True)
            return
        kept = KeptRounds.read(rounds)
        if kept.step > step or kept.probe != self.probe.fingerprint:
            shutil.rmtree(self.best_dir)  # chosen after the checkpoint resumed from, or measured otherwise
            return
        self.best, self.best_weights = _measured(kept), load_file(str(self.best_dir / BEST_WEIGHTS))

    def end_due(self, step: int) -> bool:
        """Whether a run resumed at its last step, `step`, must measure it again to choose the weights it ends
        with: its checkpoint saved no measurement of it (an eagle3 that saved none wrote it, or it was measured
        on other prompts). If so, the step is due as the last step is, with its confirmation; this process
        trained nothing to budget it against."""
        if self.cfg.keep != "best_al" or (self.last is not None and self.last.step == step):
            return False
        self.total, self.projected = step, None
        return True

    def kept_weights(self) -> dict[str, torch.Tensor] | None:
        if self.cfg.keep != "best_al" or self.last is None:
            return None
        return None if self._kept() is self.last else self.best_weights

    def selection(self, measured_steps: list[int]) -> ALSelection | None:
        """The kept step against the last, paired over the same prompts (None without a measured last step)."""
        if self.cfg.keep != "best_al" or self.last is None:
            return None
        k, kept, last = self.probe.k, self._kept(), self.last
        diff = paired_al_difference(kept.runs, last.runs)
        return ALSelection(
            k=k,
            prompts=len(last.runs),
            kept_step=kept.step,
            kept_al=round(pooled_runs_al(kept.runs, k), 4),
            last_step=last.step,
            last_al=round(pooled_runs_al(last.runs, k), 4),
            difference=round(diff.difference, 4),
            difference_ci95=[round(x, 4) for x in diff.ci95],
            measured_steps=measured_steps,
        )


def _measured(rounds: KeptRounds) -> Measured:
    return Measured(rounds.step, [PromptRun(tuple(r), PathTiming(), PathTiming()) for r in rounds.accepted])
