"""A drafter trained by the PyPI `speculators` package (0.9.0) loads into eagle3 as the same network.

For each variant speculators trains (its flags norm_before_fc, fc_norm, norm_output, norm_before_residual, and
a sliding window), a tiny `Eagle3DraftModel` is built, trained a few optimizer steps with speculators' own
data shift, forward and loss, saved with its own `save_pretrained`, and loaded with eagle3's
`load_drafter_dir` from the directory alone. eagle3's draft logits must then equal speculators' own forward's,
at every TTT step, in float32.

Conventions. speculators shifts a sequence (x, g) of tokens and aux states by one (`models/eagle3/data.py`):
entry p pairs g[p] with x[p+1] at position p+1, and step k reads x[p+1+k] at p+1+k. eagle3's
`ttt_forward(aux, ids)` pairs aux[p] with ids[p+1+k] at position p+k: the same drafts, one position earlier.
RoPE is relative, so the offset changes nothing but float rounding.

The sliding window. speculators' TTT mask windows step k's entry p by its step-0 index (keys j > p - W of the
prefix), while the engines window the draft query by its position p + k (j > p + k - W), which is eagle3's
rule. The two agree at step 0, and at step k on the entries p < W - k, where neither cuts anything; elsewhere
they differ, and the test shows it. It then runs speculators' own trained layer under the engines' mask and
finds eagle3's logits equal at every step and entry.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from eagle3_core.export import load_drafter_dir
from tests.conftest import in_ci
from tests.helpers import FLAG_VARIANTS, SPECULATORS_FLAGS

HIDDEN, VOCAB, DRAFT_VOCAB = 64, 300, 200
LENGTH, STEPS, WINDOW = 24, 3, 8
AUX_LAYERS = [1, 3, 5]
TRAIN_STEPS = 6
VARIANTS: dict[str, dict[str, Any]] = {
    **FLAG_VARIANTS,
    # what speculators' own trainer defaults to (train/config/schema.py, train/cli.py): a 2048 window on
    # every layer, wider than this sequence, and the three flags
    "speculators_defaults": {**SPECULATORS_FLAGS, "sliding_window": 2048},
    "sliding_window": {"sliding_window": WINDOW},  # narrower than the sequence
}

pytestmark = [
    # its calling convention under transformers 5.24
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]


def speculators() -> ModuleType:
    """The package. In CI it must be there (make test installs it); a laptop may lack it."""
    if in_ci():
        import speculators as module

        return module
    return pytest.importorskip("speculators", reason="speculators is not installed (make test installs it)")


def build(variant: dict[str, Any]) -> Any:
    """A tiny speculators Eagle3DraftModel over a Llama layer, its verifier weights set by hand (what
    `load_verifier_weights` would copy from a verifier: embedding, the draft rows of lm_head, final norm)."""
    speculators()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    flags = dict(variant)
    window = flags.pop("sliding_window", None)
    layer = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # as speculators' create_transformer_layer_config writes a window
        **({"sliding_window": window, "layer_types": ["sliding_attention"]} if window else {}),
    )
    layer._attn_implementation = "eager"  # CPU: flex attention has no backward here
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=flags.pop("norm_before_residual", False),
        norm_before_fc=flags.pop("norm_before_fc", False),
        fc_norm=flags.pop("fc_norm", False),
        norm_output=flags.pop("norm_output", False),
        eagle_aux_hidden_state_layer_ids=AUX_LAYERS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    assert not flags, flags
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    g = torch.Generator().manual_seed(1)
    draft_ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    model.load_vocab_mappings(t2d, draft_ids - torch.arange(DRAFT_VOCAB))
    verifier_head = torch.randn(VOCAB, HIDDEN, generator=g)[t2d]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        model.lm_head.weight.copy_(verifier_head)  # the trainer starts lm_head as the verifier's
        model.verifier_lm_head.weight.copy_(verifier_head)
        model.verifier_norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=g))
    return model


def raw_sample(seed: int) -> dict[str, torch.Tensor]:
    """One sequence as speculators' dataloader gives it, before its shift: tokens, aux states, the verifier's
    last state; the last token is 0 (eagle3's right padding, so both see the same token stream)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (LENGTH + 1,), generator=g)
    ids[-1] = 0
    return {
        "input_ids": ids,
        "hidden_states": torch.randn(LENGTH + 1, 3 * HIDDEN, generator=g),
        "verifier_last_hidden_states": torch.randn(LENGTH + 1, HIDDEN, generator=g),
        "loss_mask": torch.ones(LENGTH + 1, dtype=torch.bool),
        "lengths": torch.tensor([LENGTH + 1]),
        "position_ids": torch.arange(LENGTH + 1),
    }


def shifted(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' own shift (models/eagle3/data.py), batched as its collate does: [1, T, ...]."""
    from speculators.models.eagle3.data import shift_batch

    batch = shift_batch(sample)
    return {k: v[None] for k, v in batch.items() if k != "lengths"}


def train(model: Any) -> list[float]:
    """A few AdamW steps on speculators' own TTT loss (its forward returns it given the verifier's state)."""
    # the kwargs its trainer passes the forward; the eager loss (the fused one needs Triton, absent on CPU)
    train_kwargs, _ = type(model).get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=STEPS, ttt_step_loss_decay=1.0
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    batch = shifted(raw_sample(seed=7))
    losses = []
    model.train()
    for _ in range(TRAIN_STEPS):
        _, loss, _ = model(
            hidden_states=batch["hidden_states"],
            input_ids=batch["input_ids"],
            document_ids=torch.zeros(1, LENGTH, dtype=torch.long),
            loss_mask=batch["loss_mask"],
            position_ids=batch["position_ids"],
            verifier_last_hidden_states=batch["verifier_last_hidden_states"],
            **train_kwargs,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def speculators_logits(model: Any, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each TTT step's draft logits from speculators' own forward (its lm_head's outputs, in order)."""
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    try:
        model.eval()
        with torch.no_grad():
            model(
                hidden_states=batch["hidden_states"],
                input_ids=batch["input_ids"],
                document_ids=torch.zeros(1, LENGTH, dtype=torch.long),
                position_ids=batch["position_ids"],
                ttt_steps=STEPS,
            )
    finally:
        hook.remove()
    assert len(logits) == STEPS
    return logits


def engine_window_mask(kv_length: int, window: int) -> torch.Tensor:
    """speculators' eager mask layout [1, 1, T, (k+1)T] (0 / -inf), with the engines' window: step k's entry p
    (position p + k) sees prefix keys j <= p with j > p + k - W, and its own entry of each later step."""
    step = kv_length // LENGTH - 1
    q = torch.arange(LENGTH)[:, None]
    kv = torch.arange(kv_length)[None, :]
    prefix = (kv < LENGTH) & (kv <= q) & (kv > q + step - window)
    chain = (kv >= LENGTH) & (kv % LENGTH == q)
    mask = torch.zeros(LENGTH, kv_length).masked_fill(~(prefix | chain), float("-inf"))
    return mask[None, None]


@pytest.fixture(scope="module", params=list(VARIANTS))
def trained(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, Path]:
    """(variant, the trained speculators model, the directory its save_pretrained wrote)."""
    model = build(VARIANTS[request.param])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = train(model)
    assert losses[-1] < losses[0], losses  # it learnt
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert any("norm" in n for n in moved) and "fc.weight" in moved  # trained norms are what gets compared
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return request.param, model, out


def test_a_speculators_trained_drafter_loads_with_the_same_logits(trained: tuple[str, Any, Path]) -> None:
    name, model, out = trained
    variant = VARIANTS[name]
    assert (out / "model.safetensors").is_file() and (
        out / "config.json"
    ).is_file()  # what save_pretrained wrote

    loaded = load_drafter_dir(out)  # format from config.json; the embedding travels with it
    cfg = loaded.drafter.cfg
    assert loaded.info.format == "speculators" and loaded.info.external
    assert loaded.info.aux_layer_ids == tuple(AUX_LAYERS) and loaded.info.dtype == torch.float32
    for flag in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
        assert getattr(cfg, flag) is variant.get(flag, False), flag
    assert cfg.sliding_window == variant.get("sliding_window")
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)

    sample = raw_sample(seed=11)
    batch = shifted(sample)
    theirs = speculators_logits(model, batch)
    # eagle3's convention on the same sequence: aux[p] = g[p], ids = x (its ids[p + 1] is speculators' entry p)
    with torch.no_grad():
        ours = loaded.drafter.ttt_forward(
            sample["hidden_states"][None, :LENGTH], sample["input_ids"][None, :LENGTH], STEPS
        )

    window = variant.get("sliding_window")
    if window is None or window >= LENGTH + STEPS:
        for step in range(STEPS):
            torch.testing.assert_close(ours[step], theirs[step], rtol=1e-5, atol=1e-5, msg=f"step {step}")
        return

    # a window narrower than the sequence: the two rules agree at step 0, and later where neither cuts
    for step in range(STEPS):
        agree = torch.arange(LENGTH) < window - step if step else torch.ones(LENGTH, dtype=torch.bool)
        torch.testing.assert_close(
            ours[step][:, agree], theirs[step][:, agree], rtol=1e-5, atol=1e-5, msg=f"step {step}"
        )
        if step:  # and differ where speculators' step-0-index window admits keys the engines' does not
            assert float((ours[step][:, ~agree] - theirs[step][:, ~agree]).abs().max()) > 1e-3, step

    # speculators' own trained layer under the engines' window rule: eagle3's logits, everywhere
    def engine_rule(_module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        mask = kwargs["attention_mask"]
        return args, {**kwargs, "attention_mask": engine_window_mask(mask.shape[-1], window).to(mask.device)}

    handle = model.layers[0].register_forward_pre_hook(engine_rule, with_kwargs=True)
    try:
        served = speculators_logits(model, batch)
    finally:
        handle.remove()
    for step in range(STEPS):
        torch.testing.assert_close(ours[step], served[step], rtol=1e-5, atol=1e-5, msg=f"step {step}")
