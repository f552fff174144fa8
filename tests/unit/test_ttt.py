"""The vectorised TTT forward equals a plain step-by-step loop with an explicit KV cache (float64)."""

import pytest
import torch

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter, rope, ttt_mask

CFG = DrafterConfig(
    target_hidden_size=24,
    hidden_size=16,
    intermediate_size=40,
    num_heads=4,
    num_kv_heads=2,
    target_vocab_size=50,
    draft_vocab_size=30,
)


def reference_logits(model: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """One sequence, one entry at a time, as an engine drafts: [steps, T, V]. No masks, no batching."""
    layer, attn, cfg = model.midlayer, model.midlayer.self_attn, model.cfg
    t, d, groups = ids.shape[0], cfg.dim, cfg.num_heads // cfg.num_kv_heads

    def token(i: int) -> torch.Tensor:
        return ids[i] if i < t else torch.tensor(0)

    def qkv(tok: torch.Tensor, h: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.cat([layer.input_layernorm(model.embed_tokens(tok)), layer.hidden_norm(h)])
        q = attn.q_proj(x).view(cfg.num_heads, 1, d)
        k = attn.k_proj(x).view(cfg.num_kv_heads, 1, d)
        v = attn.v_proj(x).view(cfg.num_kv_heads, 1, d)
        p = torch.tensor([pos])
        return rope(q, p, cfg.rope_theta)[:, 0], rope(k, p, cfg.rope_theta)[:, 0], v[:, 0]

    def attend(q: torch.Tensor, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(cfg.num_heads, d, dtype=q.dtype)
        for head in range(cfg.num_heads):
            kv = head // groups
            scores = torch.stack([q[head] @ k[kv] for k in cache_k]) / d**0.5
            weights = torch.softmax(scores, dim=0)
            out[head] = sum(w * v[kv] for w, v in zip(weights, cache_v, strict=True))
        return attn.o_proj(out.reshape(-1))

    out = torch.zeros(steps, t, cfg.draft_vocab_size, dtype=aux.dtype)
    prefix_k: list[torch.Tensor] = []
    prefix_v: list[torch.Tensor] = []
    for p in range(t):  # extend: entry p pairs fc(aux[p]) with token p+1, at position p
        h = model.fc(aux[p])
        q, k, v = qkv(token(p + 1), h, p)
        prefix_k.append(k)
        prefix_v.append(v)
        chain_k, chain_v = list(prefix_k), list(prefix_v)
        h = layer.finish(h, attend(q, chain_k, chain_v))
        out[0, p] = model.lm_head(model.norm(h))
        for step in range(1, steps):  # decode along entry p's own chain
            q, k, v = qkv(token(p + 1 + step), h, p + step)
            chain_k.append(k)
            chain_v.append(v)
            h = layer.finish(h, attend(q, chain_k, chain_v))
            out[step, p] = model.lm_head(model.norm(h))
    return out


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_vectorised_ttt_equals_the_step_by_step_reference(steps: int) -> None:
    torch.manual_seed(steps)
    model = Eagle3Drafter(CFG).double()
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
def test_flex_attention_block_mask_gives_the_sdpa_logits() -> None:
    # eager flex attention on CPU: the same BlockMask and kernel interface the GPU path compiles
    torch.manual_seed(3)
    model = Eagle3Drafter(CFG)
    aux = torch.randn(2, 13, 3 * CFG.target_hidden_size)
    ids = torch.randint(0, CFG.target_vocab_size, (2, 13))
    with torch.no_grad():
        sdpa = model.ttt_forward(aux, ids, 3, attention="sdpa")
        flex = model.ttt_forward(aux, ids, 3, attention="flex")
    for a, b in zip(sdpa, flex, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
