"""The graphed target step computes what transformers' forward computes, for every family it accepts, across
appends and roll-backs, and speculative decoding through it is still the target's own output. On a CPU the
step runs eagerly (the same code a CUDA graph captures on a GPU); float64 keeps the comparisons far from any
argmax tie, whatever kernels the CPU runs."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from eagle3_core.errors import ConfigError
from eagle3_core.evaluate import measure as measure_module
from eagle3_core.evaluate.measure import DecodeSettings, measure, target_references
from eagle3_core.evaluate.specdec import speculative_generate, target_generate
from eagle3_core.targets.graphed import (
    GraphedTarget,
    UnsupportedTargetError,
    choose_target_step,
    runs_graphed,
)
from tests.helpers import TINY_TARGET_SIZES as SIZES
from tests.helpers import random_drafter, tiny_family_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
AUX = (1, 3, 5)


def _reference(model: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[k][0] for k in AUX], dim=-1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_appends_and_roll_backs_compute_what_the_whole_forward_does(family: str) -> None:
    model = tiny_family_model(family)
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, aux = _reference(model, ids)
    step = GraphedTarget(model, AUX, capacity=32, graph_widths={1, 4})
    step.reset()
    got_logits, got_aux = step.extend(torch.tensor(ids[:9]))  # a prompt
    torch.testing.assert_close(got_logits, logits[:9], rtol=0, atol=1e-10)
    torch.testing.assert_close(got_aux, aux[:9], rtol=0, atol=1e-10)
    step.extend(torch.tensor([63, 62, 61, 60]))  # drafts the target rejects ...
    step.keep(9)  # ... rolled back: their slots hold stale keys until written again
    for start, end in ((9, 13), (13, 14), (14, 20)):
        got_logits, got_aux = step.extend(torch.tensor(ids[start:end]))
        torch.testing.assert_close(got_logits, logits[start:end], rtol=0, atol=1e-10)
        torch.testing.assert_close(got_aux, aux[start:end], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="exceed the graphed target's capacity 32"):
        step.extend(torch.zeros(13, dtype=torch.long))


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_through_it_is_the_target_s_own_output(k: int) -> None:
    model = tiny_family_model("llama")
    drafter, d2t = random_drafter(torch.arange(0, 64, 2), seed=k)
    step = GraphedTarget(model, AUX, capacity=64, graph_widths={1, k + 1})
    g = torch.Generator().manual_seed(k)
    for _ in range(3):
        prompt = torch.randint(0, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        expected = target_generate(model, prompt, 24, eos_ids=set())
        assert target_generate(model, prompt, 24, eos_ids=set(), graphed=step) == expected
        eager = speculative_generate(model, drafter, d2t, AUX, prompt, 24, k, eos_ids=set())
        graphed = speculative_generate(model, drafter, d2t, AUX, prompt, 24, k, eos_ids=set(), graphed=step)
        assert graphed.tokens == expected and graphed.accepted == eager.accepted


def test_measure_with_the_graphed_target_pools_the_same_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []
    extend = GraphedTarget.extend
    monkeypatch.setattr(
        GraphedTarget, "extend", lambda self, ids: steps.append(ids.numel()) or extend(self, ids)
    )
    model = tiny_family_model("llama")
    drafter, d2t = random_drafter(torch.arange(0, 64, 2), seed=5)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    eager = measure(model, drafter, d2t, AUX, prompts, set(), DecodeSettings((1, 3), 16))
    graphed = measure(
        model, drafter, d2t, AUX, prompts, set(), DecodeSettings((1, 3), 16, graphed_target=True)
    )
    assert steps and set(steps) >= {1, 2, 4}  # the graphed runs went through it: decode and verify widths
    for k in (1, 3):
        assert [r.accepted for r in graphed.runs[k]] == [r.accepted for r in eager.runs[k]]
    assert graphed.greedy_mismatches == {1: 0, 3: 0}


def test_references_decoded_once_stand_for_the_target_alone_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_family_model("llama")
    drafter, d2t = random_drafter(torch.arange(0, 64, 2), seed=5)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    settings = DecodeSettings((1, 3), 16, graphed_target=True)
    whole = measure(model, drafter, d2t, AUX, prompts, set(), settings)
    references = target_references(model, AUX, prompts, set(), settings)
    calls: list[int] = []
    target_generate = measure_module.target_generate
    monkeypatch.setattr(
        measure_module, "target_generate", lambda *a, **kw: calls.append(1) or target_generate(*a, **kw)
    )
    shared = measure(model, drafter, d2t, AUX, prompts, set(), settings, references=references)
    assert not calls  # the target alone was not decoded again
    for k in (1, 3):
        assert [r.accepted for r in shared.runs[k]] == [r.accepted for r in whole.runs[k]]
        assert [r.target.tokens for r in shared.runs[k]] == [r.target.tokens for r in whole.runs[k]]
    assert shared.greedy_mismatches == {1: 0, 3: 0}
    wrong = [[*r[:-1], (r[-1] + 1) % 64] for r in references]  # each reference's last token changed
    assert measure(
        model, drafter, d2t, AUX, prompts, set(), settings, references=wrong
    ).greedy_mismatches == {1: 3, 3: 3}
    with pytest.raises(ValueError, match="2 references for 3 prompts"):
        measure(model, drafter, d2t, AUX, prompts, set(), settings, references=references[:2])

    # acceptance alone (what training measures): the target alone is not decoded, the rounds are the same
    calls.clear()
    rounds = measure(model, drafter, d2t, AUX, prompts, set(), settings, target_alone=False)
    assert not calls and rounds.greedy_mismatches == {}
    for k in (1, 3):
        assert [r.accepted for r in rounds.runs[k]] == [r.accepted for r in whole.runs[k]]
        assert all(r.target.tokens == 0 for r in rounds.runs[k])


def test_what_it_cannot_compute_is_refused_in_one_line() -> None:
    sliding = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    sliding.config.sliding_window = 16
    with pytest.raises(UnsupportedTargetError, match="sliding-window attention"):
        GraphedTarget(sliding, AUX, capacity=8)
    with pytest.raises(
        UnsupportedTargetError, match=r"aux layers \(1, 3, 6\) must be inputs of the 6 layers"
    ):
        GraphedTarget(tiny_family_model("llama"), (1, 3, 6), capacity=8)
    with pytest.raises(UnsupportedTargetError, match="model_type None is not one of llama"):
        GraphedTarget(torch.nn.Linear(2, 2), AUX, capacity=8)


def test_a_layout_it_does_not_compute_is_caught_by_the_probe_against_transformers() -> None:
    """A family outside the list is refused by its model_type; a model of a listed type whose layer does more
    than the step computes (here a layer that scales its output) is refused by the probe that compares the
    step with transformers' own forward, before anything is decoded."""
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=8)).double().eval()
    with pytest.raises(UnsupportedTargetError, match="model_type 'gemma' is not one of"):
        GraphedTarget(gemma, AUX, capacity=32)
    model = tiny_family_model("llama")
    layer = model.model.layers[2]
    plain = layer.forward
    layer.forward = lambda *args, **kwargs: plain(*args, **kwargs) * 1.5  # type: ignore[method-assign]
    with pytest.raises(UnsupportedTargetError, match="logits differ from transformers' forward by"):
        GraphedTarget(model, AUX, capacity=32)


def test_evaluate_target_step_takes_the_graphed_step_where_it_runs_and_says_why_not() -> None:
    """auto: graphed on a GPU where it computes the target, found as a run finds it (family, aux layers, the
    probe against transformers' forward), else eager with the reason; graphed: on any device, and a target it
    cannot compute refused naming the setting."""
    llama = tiny_family_model("llama")
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=8)).double().eval()
    scaled = tiny_family_model("llama")  # a listed family whose layer does more than the step computes
    plain = scaled.model.layers[2].forward
    scaled.model.layers[2].forward = lambda *a, **kw: plain(*a, **kw) * 1.5  # type: ignore[method-assign]
    assert runs_graphed("auto", llama, AUX, "cuda") and runs_graphed("graphed", llama, AUX, "cpu")
    assert not runs_graphed("eager", llama, AUX, "cuda")
    assert choose_target_step("auto", llama, AUX, "cpu") == (
        False,
        "evaluate.target_step auto: graphed only on a GPU, this is cpu",
    )
    for model, why in (
        (gemma, "model_type 'gemma' is not one of llama"),
        (scaled, "logits differ from transformers' forward"),
        (llama, r"aux layers \(1, 3, 6\) must be inputs of the 6 layers"),
    ):
        aux = (1, 3, 6) if model is llama else AUX
        graphed, reason = choose_target_step("auto", model, aux, "cuda")
        assert not graphed and re.search(why, reason), reason
        with pytest.raises(ConfigError, match=f"evaluate.target_step graphed: .*{why}"):
            runs_graphed("graphed", model, aux, "cpu")
