"""Packed batches compute what padded ones do: each sample's states, masks, loss and gradients are those it has
alone (float64 throughout, so agreement is to rounding, where a leak across samples would move states by
~1e-1), and the flex BlockMask built from the samples' extents
marks exactly the blocks the mask needs. Drafting from only the entries a loss reads (`Packing.drafted`)
changes no state, loss, count or gradient."""

import pytest
import torch

from eagle3_core.draft.model import FLEX_BLOCK, Eagle3Drafter, Packing, packed_block_masks
from eagle3_core.train.loss import chunked_ttt_targets, drafted_entries, lean_ttt_loss, step_masks
from tests.fakes import tiny_drafter_config

CFG = tiny_drafter_config()
LENGTHS = [100, 90, 40]  # 230 of a 256-entry row, then padding
WIDTH = 2 * FLEX_BLOCK
STEPS = 4


def packing(lengths: list[int], width: int) -> Packing:
    doc = torch.full((1, width), len(lengths), dtype=torch.int32)
    positions = torch.zeros(1, width, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lengths):
        doc[0, start : start + n], positions[0, start : start + n] = i, torch.arange(n)
        start += n
    positions[0, start:] = torch.arange(width - start)
    return Packing(doc, positions)


def starts(lengths: list[int]) -> list[int]:
    return [sum(lengths[:i]) for i in range(len(lengths))]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_each_sample_of_a_packed_row_gets_the_states_it_has_alone(attention: str, window: int | None) -> None:
    torch.manual_seed(0)
    model = Eagle3Drafter(CFG.model_copy(update={"sliding_window": window})).double()
    ids = torch.randint(0, CFG.target_vocab_size, (1, WIDTH))
    aux = torch.randn(1, WIDTH, 3 * CFG.target_hidden_size, dtype=torch.float64)
    with torch.no_grad():  # eager flex attention has no backward on CPU
        packed = model.ttt_states(aux, ids, STEPS, attention, packing(LENGTHS, WIDTH))  # type: ignore[arg-type]
        for start, n in zip(starts(LENGTHS), LENGTHS, strict=True):
            alone = model.ttt_states(aux[:, start : start + n], ids[:, start : start + n], STEPS, "sdpa")
            for k in range(STEPS):
                valid = n - k - 1  # entries whose input token lies inside the sample
                torch.testing.assert_close(
                    packed[k][0, start : start + valid], alone[k][0, :valid], rtol=1e-5, atol=1e-7
                )


@pytest.mark.parametrize("window", [None, 40, 200])
def test_the_packed_block_masks_hold_every_allowed_entry_and_full_blocks_only_where_all_are(
    window: int | None,
) -> None:
    doc = packing([300, 90, 40, 26], WIDTH * 2).doc  # 4 blocks: the first sample fills 2, samples cross edges
    n, t = 4, WIDTH * 2
    masks = packed_block_masks(doc, STEPS, window)
    assert len(masks) == STEPS and (window is not None or all(m is masks[0] for m in masks))
    for k, mask in enumerate(masks):
        q, kv = torch.arange(t)[:, None], torch.arange(t)[None, :]
        expected = (kv <= q) & (doc[0, kv] == doc[0, q])  # the prefix: the chain is merged outside flex
        if window is not None:
            expected &= kv > q + k - window
        dense = mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
        assert torch.equal(dense, expected)
        blocks = expected.view(n, FLEX_BLOCK, n, FLEX_BLOCK)
        some, every = blocks.any(3).any(1), blocks.all(3).all(1)
        marked = mask.to_dense()[0, 0].bool()  # partial and full blocks
        assert torch.equal(marked, some)  # no allowed entry skipped, no empty block computed
        full = torch.zeros_like(marked)
        counts, indices = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
        for i in range(n):
            full[i, indices[i, : counts[i]].long()] = True
        assert torch.equal(full, every)  # full blocks skip the mask: only where every entry is allowed
        assert full.any() == (window is None)


def prompted_mask(lengths: list[int], width: int, prompt: float) -> torch.Tensor:
    """uint8 [1, width]: each sample's first `prompt` share of tokens masked (a chat's prompt), padding 0."""
    mask = torch.zeros(1, width, dtype=torch.uint8)
    for start, n in zip(starts(lengths), lengths, strict=True):
        mask[0, start + int(n * prompt) : start + n] = 1
    return mask


def test_the_drafted_entries_hold_every_entry_any_step_counts_and_pad_with_one_that_never_counts() -> None:
    lengths = [300, 90, 40, 26]
    pk = packing(lengths, WIDTH * 2)
    mask = prompted_mask(lengths, WIDTH * 2, 0.6)
    drafted = drafted_entries(mask, pk.doc, STEPS, FLEX_BLOCK)
    everything = torch.ones(1, WIDTH * 2, dtype=torch.bool)
    counted = step_masks(mask, everything, STEPS, pk.doc).any(0)[0]  # [T]: some step counts the entry
    kept = drafted[0][drafted[0] != WIDTH * 2 - 1]
    assert drafted.shape[1] % FLEX_BLOCK == 0 and drafted.shape[1] < WIDTH * 2
    assert torch.equal(kept, counted.nonzero().squeeze(1))  # all the counted, ascending, nothing else
    assert not counted[-1]  # the padding entry never counts
    assert torch.equal(
        drafted[0, kept.numel() :], torch.full((drafted.shape[1] - kept.numel(),), WIDTH * 2 - 1)
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_drafting_from_the_counted_entries_gives_their_states_unchanged(
    attention: str, window: int | None
) -> None:
    torch.manual_seed(2)
    lengths = [300, 90, 40, 26]
    width = WIDTH * 2
    model = Eagle3Drafter(CFG.model_copy(update={"sliding_window": window})).double()
    ids = torch.randint(0, CFG.target_vocab_size, (1, width))
    aux = torch.randn(1, width, 3 * CFG.target_hidden_size, dtype=torch.float64)
    every = packing(lengths, width)
    drafted = drafted_entries(prompted_mask(lengths, width, 0.6), every.doc, STEPS, FLEX_BLOCK)
    with torch.no_grad():
        whole = model.ttt_states(aux, ids, STEPS, attention, every)  # type: ignore[arg-type]
        some = model.ttt_states(aux, ids, STEPS, attention, Packing(every.doc, every.positions, drafted))  # type: ignore[arg-type]
    for k in range(STEPS):
        assert some[k].shape[1] == drafted.shape[1]
        torch.testing.assert_close(some[k][0], whole[k][0, drafted[0]], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("window", [None, 40])
def test_the_drafted_block_masks_hold_every_allowed_entry_and_full_blocks_exactly_where_all_are(
    window: int | None,
) -> None:
    lengths = [300, 90, 40, 26]
    t = WIDTH * 2
    doc = packing(lengths, t).doc
    drafted = drafted_entries(prompted_mask(lengths, t, 0.6), doc, STEPS, FLEX_BLOCK)
    m = drafted.shape[1]
    nq, nk = m // FLEX_BLOCK, t // FLEX_BLOCK
    for k, mask in enumerate(packed_block_masks(doc, STEPS, window, drafted)):
        q, kv = torch.arange(m)[:, None], torch.arange(t)[None, :]
        entry = drafted[0, q]  # [m, 1]: the query's entry
        expected = (kv <= entry) & (doc[0, kv] == doc[0, entry])
        if window is not None:
            expected &= kv > entry + k - window
        assert torch.equal(mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv), expected)
        blocks = expected.view(nq, FLEX_BLOCK, nk, FLEX_BLOCK)
        some, every = blocks.any(3).any(1), blocks.all(3).all(1)
        marked = mask.to_dense()[0, 0].bool()
        assert torch.equal(marked | some, marked)  # no allowed entry skipped
        full = torch.zeros_like(marked)
        counts, indices = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
        for i in range(nq):
            full[i, indices[i, : counts[i]].long()] = True
        assert torch.equal(full, every)  # full blocks skip the mask: exactly where every entry is allowed


def test_drafting_from_the_counted_entries_leaves_the_loss_counts_and_gradients_as_they_are() -> None:
    torch.manual_seed(3)
    lengths = [100, 90, 40]
    model = Eagle3Drafter(CFG).double()
    target_head = torch.randn(CFG.target_vocab_size, CFG.target_hidden_size, dtype=torch.float64)
    t2d = torch.zeros(CFG.target_vocab_size, dtype=torch.bool)
    t2d[torch.randperm(CFG.target_vocab_size)[: CFG.draft_vocab_size]] = True
    ids = torch.randint(0, CFG.target_vocab_size, (1, WIDTH))
    aux = torch.randn(1, WIDTH, 3 * CFG.target_hidden_size, dtype=torch.float64)
    last = torch.randn(1, WIDTH, CFG.target_hidden_size, dtype=torch.float64)
    mask = prompted_mask(lengths, WIDTH, 0.5)
    every = packing(lengths, WIDTH)

    def loss_and_grads(pk: Packing) -> tuple[float, list[float], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        targets = chunked_ttt_targets(
            lambda h: h @ target_head.T, last, mask, t2d, STEPS, 64, pk.doc, pk.drafted
        )
        states = model(aux, ids, STEPS, "sdpa", "states", pk)
        loss, stats = lean_ttt_loss(
            states, model.lm_head.weight, targets, 0.8, None, "kl", torch.float64, chunk_tokens=50
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return float(loss.detach()), [float(c) for c in stats.sums.flatten()], grads

    drafted = drafted_entries(mask, every.doc, STEPS, FLEX_BLOCK)
    assert drafted.shape[1] == FLEX_BLOCK  # half of each sample is prompt: one block of the row's two
    whole_loss, whole_sums, whole_grads = loss_and_grads(every)
    some_loss, some_sums, some_grads = loss_and_grads(Packing(every.doc, every.positions, drafted))
    assert some_loss == pytest.approx(whole_loss, rel=1e-9)
    assert some_sums == pytest.approx(whole_sums, rel=1e-9)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(some_grads[name], grad, rtol=1e-4, atol=1e-8)


def test_a_packed_row_of_other_length_than_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of 128"):
        packed_block_masks(torch.zeros(1, 200, dtype=torch.int32), 2)


def test_a_packed_batch_has_the_loss_and_gradients_of_the_padded_batch_of_its_samples() -> None:
    torch.manual_seed(1)
    model = Eagle3Drafter(CFG).double()
    target_head = torch.randn(CFG.target_vocab_size, CFG.target_hidden_size, dtype=torch.float64)
    t2d = torch.zeros(CFG.target_vocab_size, dtype=torch.bool)
    t2d[torch.randperm(CFG.target_vocab_size)[: CFG.draft_vocab_size]] = True
    lengths = [37, 52, 20, 44]
    total = sum(lengths)
    ids = torch.randint(0, CFG.target_vocab_size, (total,))
    aux = torch.randn(total, 3 * CFG.target_hidden_size, dtype=torch.float64)
    last = torch.randn(total, CFG.target_hidden_size, dtype=torch.float64)
    loss_mask = (torch.rand(total) > 0.25).to(torch.uint8)

    def loss_and_grads(
        ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor, mask: torch.Tensor, packed: Packing | None
    ) -> tuple[float, list[float], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        doc = packed.doc if packed is not None else None
        targets = chunked_ttt_targets(lambda h: h @ target_head.T, last, mask, t2d, STEPS, 64, doc)
        states = model(aux, ids, STEPS, "sdpa", "states", packed)
        loss, stats = lean_ttt_loss(
            states, model.lm_head.weight, targets, 0.8, None, "kl", torch.float64, chunk_tokens=50
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return float(loss.detach()), [float(c) for c in stats.sums[3]], grads

    # padded: a sample per row, right-padded; packed: all four back to back in one row of 256
    longest = max(lengths)
    rows = [
        torch.zeros(len(lengths), longest, *x.shape[1:], dtype=x.dtype) for x in (ids, aux, last, loss_mask)
    ]
    for r, (start, n) in enumerate(zip(starts(lengths), lengths, strict=True)):
        for padded, x in zip(rows, (ids, aux, last, loss_mask), strict=True):
            padded[r, :n] = x[start : start + n]
    pad = [torch.zeros(WIDTH - total, *x.shape[1:], dtype=x.dtype) for x in (ids, aux, last, loss_mask)]
    row = [torch.cat([x, p])[None] for x, p in zip((ids, aux, last, loss_mask), pad, strict=True)]
    padded_loss, padded_counts, padded_grads = loss_and_grads(*rows, None)
    packed_loss, packed_counts, packed_grads = loss_and_grads(*row, packing(lengths, WIDTH))
    assert packed_counts == padded_counts and padded_counts[0] > 50
    assert packed_loss == pytest.approx(padded_loss, rel=1e-9)
    assert packed_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-8)
