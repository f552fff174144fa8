"""The vectorised TTT forward equals a plain step-by-step loop with an explicit KV cache (float64), for every
variant the engines read (written out here as SGLang's and vLLM's llama_eagle3.py compute them)."""

import pytest
import torch

from eagle3_core.draft.model import Eagle3Drafter, merge_chain, rope, ttt_mask
from tests.fakes import tiny_drafter_config
from tests.helpers import FLAG_VARIANTS, SPECULATORS_FLAGS

CFG = tiny_drafter_config()


VARIANTS: dict[str, dict[str, object]] = {
    **FLAG_VARIANTS,
    "speculators_defaults": SPECULATORS_FLAGS,
    "sliding_window": {"sliding_window": 4},
}


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def engine_features(model: Eagle3Drafter, aux: torch.Tensor) -> torch.Tensor:
    """fc over the aux states, after input_norm (norm_before_fc) or one norm per aux chunk (fc_norm)."""
    cfg = model.cfg
    if cfg.norm_before_fc:
        assert model.input_norm is not None
        aux = rms(aux, model.input_norm.weight, cfg.rms_norm_eps)
    if cfg.fc_norm:
        assert model.fc_norm is not None
        chunks = aux.split(cfg.target_hidden_size, dim=-1)
        aux = torch.cat(
            [rms(c, n.weight, cfg.rms_norm_eps) for c, n in zip(chunks, model.fc_norm, strict=True)], -1
        )
    return model.fc(aux)


def reference_logits(model: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """One sequence, one entry at a time, as an engine drafts: [steps, T, V]. No masks, no batching."""
    layer, attn, cfg = model.midlayer, model.midlayer.self_attn, model.cfg
    t, d, groups = ids.shape[0], cfg.dim, cfg.num_heads // cfg.num_kv_heads
    window = cfg.sliding_window or 10**9

    def token(i: int) -> torch.Tensor:
        return ids[i] if i < t else torch.tensor(0)

    def qkv(tok: torch.Tensor, h: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.cat([layer.input_layernorm(model.embed_tokens(tok)), layer.hidden_norm(h)])
        q = attn.q_proj(x).view(cfg.num_heads, 1, d)
        k = attn.k_proj(x).view(cfg.num_kv_heads, 1, d)
        v = attn.v_proj(x).view(cfg.num_kv_heads, 1, d)
        p = torch.tensor([pos])
        return rope(q, p, cfg.rope_theta)[:, 0], rope(k, p, cfg.rope_theta)[:, 0], v[:, 0]

    def attend(
        q: torch.Tensor, pos: int, cache: list[tuple[int, torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        seen = [(k, v) for at, k, v in cache if pos - window < at <= pos]  # the engines' window, by position
        out = torch.zeros(cfg.num_heads, d, dtype=q.dtype)
        for head in range(cfg.num_heads):
            kv = head // groups
            scores = torch.stack([q[head] @ k[kv] for k, _ in seen]) / d**0.5
            weights = torch.softmax(scores, dim=0)
            out[head] = sum(w * v[kv] for w, (_, v) in zip(weights, seen, strict=True))
        return attn.o_proj(out.reshape(-1))

    def layer_out(h: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, what the next step is fed)"""
        residual = rms(h, layer.hidden_norm.weight, cfg.rms_norm_eps) if cfg.norm_before_residual else h
        h1 = residual + attn_out
        prenorm = h1 + layer.mlp(rms(h1, layer.post_attention_layernorm.weight, cfg.rms_norm_eps))
        normed = rms(prenorm, model.norm.weight, cfg.rms_norm_eps)
        return model.lm_head(normed), normed if cfg.norm_output else prenorm

    out = torch.zeros(steps, t, cfg.draft_vocab_size, dtype=aux.dtype)
    prefix: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for p in range(t):  # extend: entry p pairs fc(aux[p]) with token p+1, at position p
        h = engine_features(model, aux[p])
        q, k, v = qkv(token(p + 1), h, p)
        prefix.append((p, k, v))
        chain = list(prefix)
        out[0, p], h = layer_out(h, attend(q, p, chain))
        for step in range(1, steps):  # decode along entry p's own chain
            q, k, v = qkv(token(p + 1 + step), h, p + step)
            chain.append((p + step, k, v))
            out[step, p], h = layer_out(h, attend(q, p + step, chain))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_vectorised_ttt_equals_the_step_by_step_reference(steps: int, variant: str) -> None:
    torch.manual_seed(steps)
    model = Eagle3Drafter(CFG.model_copy(update=VARIANTS[variant])).double()
    for p in model.parameters():  # norms start at 1: randomise them so a misplaced norm shows
        torch.nn.init.normal_(p, std=0.3)
    t = 11
    aux = torch.randn(2, t, 3 * CFG.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CFG.target_vocab_size, (2, t))
    with torch.no_grad():
        fast = torch.stack(model.ttt_forward(aux, ids, steps), dim=1)  # [B, steps, T, V]
        for b in range(2):
            ref = reference_logits(model, aux[b], ids[b], steps)
            rel = (fast[b] - ref).abs().max() / ref.abs().max()
            assert rel < 1e-6, f"sequence {b}: relative error {rel:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_evaluators_decoder_drafts_what_the_reference_computes(variant: str) -> None:
    """DraftDecoder (what `eagle3 eval` runs): an extend over a prefix, then chained steps on its own outputs."""
    from eagle3_core.evaluate.specdec import DraftDecoder

    torch.manual_seed(1)
    model = Eagle3Drafter(CFG.model_copy(update=VARIANTS[variant])).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    t, steps = 9, 4
    aux = torch.randn(t, 3 * CFG.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CFG.target_vocab_size, (t,))
    with torch.no_grad():
        ref = reference_logits(model, aux, ids, steps)  # entry t-1's chain reads ids past the end as 0
        decoder = DraftDecoder(model, capacity=t + steps)
        next_tokens = torch.cat([ids[1:], torch.tensor([0])])  # entry p reads token p + 1
        logits, h = decoder.step(next_tokens, model.features(aux), torch.arange(t))
        torch.testing.assert_close(logits, ref[0])
        h = h[-1:]
        for step in range(1, steps):
            logits, h = decoder.step(torch.tensor([0]), h, torch.tensor([t - 1 + step]))
            torch.testing.assert_close(logits[0], ref[step, t - 1])


def test_a_sequence_does_not_see_its_batch_neighbours_or_the_future() -> None:
    torch.manual_seed(0)
    model = Eagle3Drafter(CFG).double()
    aux = torch.randn(2, 9, 3 * CFG.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CFG.target_vocab_size, (2, 9))
    with torch.no_grad():
        full = model.ttt_forward(aux, ids, 3)
        changed = aux.clone()
        changed[1] += 1.0
        changed[0, 6:] += 1.0  # the future of sequence 0 beyond entry 5
        other = model.ttt_forward(changed, ids, 3)
    for k in range(3):
        torch.testing.assert_close(other[k][0, :6], full[k][0, :6])
        assert not torch.allclose(other[k][1], full[k][1])


def test_ttt_mask_shape_and_blocks() -> None:
    m = ttt_mask(4, 2)
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool)) and torch.equal(
        m[:, 8:], torch.eye(4, dtype=torch.bool)
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 3])
def test_flex_attention_block_mask_gives_the_sdpa_logits(window: int | None) -> None:
    # eager flex attention on CPU: the same BlockMask and kernel interface the GPU path compiles
    torch.manual_seed(3)
    model = Eagle3Drafter(CFG.model_copy(update={"sliding_window": window}))
    aux = torch.randn(2, 13, 3 * CFG.target_hidden_size)
    ids = torch.randint(0, CFG.target_vocab_size, (2, 13))
    with torch.no_grad():
        sdpa = model.ttt_forward(aux, ids, 5, attention="sdpa")
        flex = model.ttt_forward(aux, ids, 5, attention="flex")
    for a, b in zip(sdpa, flex, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_merging_the_chain_through_the_prefix_lse_gives_attention_over_all_keys_and_its_gradients() -> None:
    # what the flex path computes (the prefix by flex, returning its lse; the chain merged outside), checked
    # here with a differentiable prefix: CPU flex attention has no backward. A query attends causally to the
    # prefix's T keys and to its own j chain keys; GQA with 2 query heads per kv head; float64.
    torch.manual_seed(5)
    b, h, kvh, t, d, j = 2, 4, 2, 9, 8, 3
    q = torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True)
    pk, pv = (torch.randn(b, kvh, t, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ck = [torch.randn(b, kvh, t, d, dtype=torch.float64, requires_grad=True) for _ in range(j)]
    cv = [torch.randn(b, kvh, t, d, dtype=torch.float64, requires_grad=True) for _ in range(j)]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    weight = torch.randn(b, h, t, d, dtype=torch.float64)  # a loss that weighs every output differently

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(h // kvh, dim=1)

    prefix_scores = (q @ grouped(pk).transpose(-1, -2) * d**-0.5).masked_fill(~causal, float("-inf"))
    prefix_out = torch.softmax(prefix_scores, -1) @ grouped(pv)
    lse = torch.logsumexp(prefix_scores, -1)
    merged = merge_chain(q, prefix_out, lse, torch.stack(ck, dim=3), torch.stack(cv, dim=3))
    inputs = [q, pk, pv, *ck, *cv]
    got = torch.autograd.grad((merged * weight).sum(), inputs, retain_graph=True)

    chain_scores = torch.stack([(q * grouped(k)).sum(-1) * d**-0.5 for k in ck], dim=-1)  # [b, h, t, j]
    weights = torch.softmax(torch.cat([prefix_scores, chain_scores], dim=-1), dim=-1)
    values = torch.stack([grouped(v) for v in cv], dim=3)  # [b, h, t, j, d]
    expected = weights[..., :t] @ grouped(pv) + (weights[..., t:, None] * values).sum(3)
    want = torch.autograd.grad((expected * weight).sum(), inputs)
    torch.testing.assert_close(merged, expected, rtol=1e-12, atol=1e-12)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
