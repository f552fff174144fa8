"""Exports of a drafter for a real (tiny) transformers Llama target: reloaded by us, and by the PyPI `speculators`
package, with the same draft logits."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from eagle3_core.draft.model import Eagle3Drafter, shift_left
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.export import ExportTarget, FormatName, export_sglang, export_speculators, load_export
from eagle3_core.targets.head import TargetHead, load_target_head
from tests.conftest import in_ci
from tests.exports import drafter_config, hand_mapping, random_drafter
from tests.helpers import FLAG_VARIANTS, save_tiny_llama

LAYERS, HIDDEN, VOCAB, K = 8, 32, 256, 48
STEPS = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("target"), layers=LAYERS, hidden=HIDDEN, vocab=VOCAB)


@pytest.fixture(scope="module")
def target(target_dir: Path) -> ExportTarget:
    return ExportTarget.from_model_dir(target_dir, (2, 4, 5), "post_norm")


@pytest.fixture(scope="module")
def head(target_dir: Path) -> TargetHead:
    return load_target_head(target_dir)


@pytest.fixture(scope="module")
def mapping() -> VocabMapping:
    return hand_mapping(VOCAB, K, seed=3)


@pytest.fixture(scope="module")
def drafter(target: ExportTarget, head: TargetHead) -> Eagle3Drafter:
    return random_drafter(drafter_config(target, K), head.embed, seed=5)


def inputs(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, length, 3 * HIDDEN, generator=g), torch.randint(0, VOCAB, (1, length), generator=g)


def test_target_facts_come_from_its_config(target: ExportTarget, target_dir: Path) -> None:
    assert (target.num_layers, target.vocab_size, target.hidden_size) == (LAYERS, VOCAB, HIDDEN)
    assert target.max_position_embeddings == 1024 and target.architectures == ("LlamaForCausalLM",)
    assert target.name_or_path == str(target_dir) and target.model_type == "llama"
    named = ExportTarget.from_model_dir(target_dir, (2, 4, 5), "pre_norm", name_or_path="org/tiny")
    assert named.name_or_path == "org/tiny" and named.final_state_convention == "pre_norm"


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_an_export_reloads_into_the_same_drafter(
    tmp_path: Path,
    fmt: FormatName,
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    head: TargetHead,
) -> None:
    export = export_sglang if fmt == "sglang" else export_speculators
    out = export(drafter, mapping, target, tmp_path / fmt, dtype=torch.float32)
    loaded = load_export(
        out, fmt, head.embed
    )  # the target's embedding (speculators: checked equal to its own)
    assert loaded.drafter.cfg == drafter.cfg
    assert torch.equal(loaded.d2t, mapping.d2t) and torch.equal(loaded.t2d, mapping.t2d)
    assert loaded.info.aux_layer_ids == (2, 4, 5) and loaded.info.final_state_convention == "post_norm"
    assert loaded.info.vocab_mapping_fingerprint == mapping.fingerprint and loaded.info.dtype == torch.float32
    aux, ids = inputs(11)
    with torch.no_grad():
        ours, theirs = drafter.ttt_forward(aux, ids, STEPS), loaded.drafter.ttt_forward(aux, ids, STEPS)
    for step in range(STEPS):
        assert torch.equal(ours[step], theirs[step]), step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # a bf16 target's, an fp16 target's
def test_an_export_reloads_as_the_drafter_in_its_dtype(
    tmp_path: Path,
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    head: TargetHead,
    dtype: torch.dtype,
) -> None:
    out = export_sglang(drafter, mapping, target, tmp_path / str(dtype), dtype=dtype)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    loaded = load_export(out, "sglang", head.embed)
    assert loaded.info.dtype == dtype and loaded.drafter.fc.weight.dtype == dtype
    reference = {k: v.to(dtype) for k, v in drafter.state_dict().items()}
    assert all(torch.equal(v, reference[k]) for k, v in loaded.drafter.state_dict().items())


# ---- the real speculators package ------------------------------------------------------------------------
def speculators_eagle3() -> ModuleType:
    """The package's Eagle3 module. In CI it must be there (make test installs it); a laptop may lack it."""
    if in_ci():
        import speculators.models.eagle3 as module

        return module
    return pytest.importorskip(
        "speculators.models.eagle3",
        reason="speculators is not installed (make test installs it; CI requires it)",
    )


VARIANTS: dict[str, dict[str, object]] = {
    **FLAG_VARIANTS,
    "sliding_window": {"sliding_window": 16},  # narrower than the 128 tokens compared
}


# its CPU attention path (unfused, exact), and its calling convention under transformers 5.24
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_speculators_package_loads_our_export_with_the_same_logits(
    tmp_path: Path,
    variant: str,
    mapping: VocabMapping,
    target: ExportTarget,
    head: TargetHead,
) -> None:
    eagle3 = speculators_eagle3()
    drafter = random_drafter(drafter_config(target, K, **VARIANTS[variant]), head.embed, seed=5)
    out = export_speculators(drafter, mapping, target, tmp_path / "speculators", dtype=torch.float32)
    # its own loader, from the directory alone: config class, weights, verifier weights (from the target dir)
    model = eagle3.Eagle3DraftModel.from_pretrained(str(out)).eval()

    config = model.config
    cfg = drafter.cfg
    for flag in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
        assert getattr(config, flag) is getattr(cfg, flag), flag
    assert model.sliding_window == cfg.sliding_window and model.uses_sliding_window_attn == (
        cfg.sliding_window is not None
    )
    assert config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert config.draft_vocab_size == K and config.transformer_layer_config.vocab_size == VOCAB
    assert torch.equal(model.d2t, mapping.d2t) and torch.equal(model.t2d, mapping.t2d)
    assert torch.equal(model.embed_tokens.weight, head.embed)
    # it takes the teacher's head as the target's lm_head rows that t2d selects: our draft ids, in order
    assert torch.equal(model.verifier_lm_head.weight, head.lm_head[mapping.draft_to_target])

    # Its TTT forward pairs hidden_states[p] with input_ids[p] at position_ids[p]; ours pairs aux[p] with
    # ids[p + 1] at position p. 128 tokens: its default flex-attention mask grows in blocks of 128.
    length = 128
    aux, ids = inputs(length, seed=1)
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out))

    def run() -> None:
        logits.clear()
        with torch.no_grad():
            model(
                hidden_states=aux,
                input_ids=shift_left(ids, 1),
                document_ids=torch.zeros(1, length, dtype=torch.long),
                position_ids=torch.arange(length)[None],
                ttt_steps=STEPS,
            )

    run()
    with torch.no_grad():
        ours = drafter.ttt_forward(aux, ids, STEPS)
    assert len(logits) == STEPS
    for step in range(STEPS):
        # speculators windows step k's entry p by its step-0 index p, the engines (and we) by its position
        # p + k: the two agree where neither cuts a key (tests/integration/test_speculators_parity.py)
        window = cfg.sliding_window
        agree = torch.arange(length) < (length if window is None or step == 0 else window - step)
        torch.testing.assert_close(
            logits[step][:, agree], ours[step][:, agree], rtol=1e-5, atol=1e-5, msg=f"step {step}"
        )

    # the comparison is sharp: speculators' other residual convention is another network (failure mode 11)
    model.layers[0].norm_before_residual = not cfg.norm_before_residual
    run()
    hook.remove()
    assert (logits[0] - ours[0]).abs().max() > 1e-2
