"""bench/_speculators.py writes what speculators 0.9.0's own readers take: read back here with its classes.

The shards hold the toy target's real states (aux layers and post-norm final state) for random token rows
with a partial loss mask; the checks go through speculators' ArrowDataset, its vocab-mapping builders and
its config resolution, not through a re-reading of our own files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from bench._speculators import (
    D2T_FILE,
    HIDDEN_STATES_DIR,
    TOKEN_FREQ_FILE,
    SpeculatorsSettings,
    pre_norm_states,
    write_offline_dataset,
    write_vocab_files,
)
from bench._training import shard_metadata
from bench.vs_speculators import eagle3_overrides, eagle3_train_config, parse_args
from eagle3_core.config import TargetConfig
from eagle3_core.draft.vocab import build_vocab_mapping
from eagle3_core.errors import ConfigError, Eagle3Error
from eagle3_core.store.shards import ShardReader, ShardWriter
from eagle3_core.targets.head import load_target_head
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.train.data import TrainingData

pytest.importorskip("speculators.train.data")

VAL_FRACTION = 0.25  # of 24 samples: both splits non-empty


@pytest.fixture(scope="module")
def shards(toy_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two shards of 12 samples each: the toy's states for random rows, loss mask on a random suffix."""
    target = TransformersTarget(toy_target_dir, TargetConfig(device="cpu"))
    out = tmp_path_factory.mktemp("shards")
    g = torch.Generator().manual_seed(0)
    paths = []
    for n in range(2):
        lengths = torch.randint(8, 40, (12,), generator=g).tolist()
        rows = [torch.randint(10, target.info.vocab_size, (t,), generator=g) for t in lengths]
        states = target.hidden_states([r.tolist() for r in rows], torch.bfloat16)
        path = out / f"chat-{n:05d}.safetensors"
        ids = [f"{n * 100 + i:064x}" for i in range(len(rows))]
        with ShardWriter(
            path,
            sample_ids=ids,
            lengths=lengths,
            hidden_size=target.info.hidden_size,
            facts=shard_metadata(target),
        ) as writer:
            for i, (row, st) in enumerate(zip(rows, states, strict=True)):
                start = int(torch.randint(1, len(row) - 1, (1,), generator=g))
                mask = torch.zeros(len(row), dtype=torch.uint8)
                mask[start:] = 1
                writer.write_sample(i, row.to(torch.int32), mask, st.aux, st.last)  # type: ignore[union-attr]
            writer.finalize()
        paths.append(path)
    target.close()
    return paths


@pytest.fixture(scope="module")
def offline(shards: list[Path], toy_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> object:
    head = load_target_head(toy_target_dir)
    assert head.final_norm is not None
    out = tmp_path_factory.mktemp("spec") / "data"
    return write_offline_dataset(
        shards,
        head.final_norm,
        out,
        val_fraction=VAL_FRACTION,
        max_val=512,
        states_dtype=torch.float32,
        log=print,
    )


def test_pre_norm_states_give_the_post_norm_state_back_through_llama_rmsnorm() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g) * 3
    norm = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.1)
        post = norm(x)
        again = norm(pre_norm_states(post, norm.weight))
    assert torch.allclose(again, post, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(pre_norm_states(post, norm.weight), post)  # it is another state than post


def test_pre_norm_states_refuse_a_zero_norm_weight() -> None:
    weight = torch.ones(8)
    weight[3] = 0.0
    with pytest.raises(Eagle3Error, match="final norm weight"):
        pre_norm_states(torch.ones(2, 8), weight)


def test_speculators_arrow_dataset_reads_every_sample_in_eagle3_split_order(
    offline: object, shards: list[Path], toy_target_dir: Path
) -> None:
    from speculators.train.data import ArrowDataset
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from bench._speculators import OfflineDataset

    assert isinstance(offline, OfflineDataset)
    head = load_target_head(toy_target_dir)
    norm = LlamaRMSNorm(head.final_norm.numel(), eps=head.rms_norm_eps)  # type: ignore[union-attr]
    with torch.no_grad():
        norm.weight.copy_(head.final_norm)  # type: ignore[arg-type]
    data = TrainingData(shards)
    train_refs, val_refs = data.split(VAL_FRACTION, 512)
    assert train_refs and val_refs
    splits = {"train": train_refs, "val": val_refs}
    for split, refs in splits.items():
        ds = ArrowDataset(
            max_len=512,
            datapath=offline.root,
            on_missing="raise",
            train_ratio=offline.train_data_ratio,
            split=split,  # type: ignore[arg-type]
            hidden_states_dtype=torch.float32,
        )
        assert len(ds) == len(refs)
        for i, ref in enumerate(refs):
            row = ds[i]
            assert isinstance(row, dict), f"{split} row {i} unavailable: {row}"
            sample = data.readers[ref.shard].sample(ref.index)
            assert torch.equal(row["input_ids"], sample.input_ids.long())
            assert torch.equal(row["loss_mask"], sample.loss_mask.long())
            assert torch.equal(row["hidden_states"], sample.aux_hidden_states.float())
            with torch.no_grad():
                teacher = norm(row["verifier_last_hidden_states"])
            # eagle3's stored post-norm state, up to the per-position scale its bf16 rounding leaves
            post = sample.last_hidden_states.float()
            scale = (teacher * post).sum(-1, keepdim=True) / (post * post).sum(-1, keepdim=True)
            assert float((scale - 1).abs().max()) < 2e-3
            assert torch.allclose(teacher, scale * post, rtol=1e-4, atol=1e-5)
    data.close()
    assert offline.samples == len(train_refs) + len(val_refs)
    assert offline.train_samples == len(train_refs)
    assert len(list((offline.root / HIDDEN_STATES_DIR).glob("hs_*.safetensors"))) == offline.samples


def test_each_states_file_passes_speculators_own_check(offline: object) -> None:
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states

    from bench._speculators import OfflineDataset

    assert isinstance(offline, OfflineDataset)
    for i in range(offline.samples):
        payload = load_file(offline.root / HIDDEN_STATES_DIR / f"hs_{i}.safetensors")
        assert payload["hidden_states"].shape[1:] == (4, offline.hidden_size)
        check_hidden_states(payload, payload["token_ids"].tolist())


def test_token_freq_and_vocab_files_give_speculators_eagle3s_draft_vocabulary(
    offline: object, shards: list[Path], tmp_path: Path
) -> None:
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from bench._speculators import OfflineDataset

    assert isinstance(offline, OfflineDataset)
    with ShardReader(shards[0]) as reader:
        fingerprint = reader.meta.tokenizer_fingerprint
        vocab = reader.meta.target_vocab_size(reader.path)
    mapping = build_vocab_mapping(shards, vocab, 64, tokenizer_fingerprint=fingerprint)
    # the frequencies speculators would build its own mapping from select the same K ids
    freq = torch.load(offline.root / TOKEN_FREQ_FILE, weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, 64, vocab)
    assert torch.equal(d2t, mapping.d2t) and torch.equal(t2d, mapping.t2d)
    # and the files it is given load, through its own CLI path, as eagle3's mapping
    d2t_path, t2d_path = write_vocab_files(mapping, tmp_path)
    assert d2t_path.name == D2T_FILE
    args = argparse.Namespace(
        d2t_path=str(d2t_path), t2d_path=str(t2d_path), draft_vocab_size=64, data_path="."
    )
    loaded_d2t, loaded_t2d, k = parse_vocab_mappings(args)
    assert k == 64
    assert torch.equal(loaded_d2t, mapping.d2t) and torch.equal(loaded_t2d, mapping.t2d)
    assert np.load(t2d_path).dtype == np.bool_


def test_a_reused_dataset_is_kept_and_another_split_rewrites_it(
    offline: object, shards: list[Path], toy_target_dir: Path
) -> None:
    from bench._speculators import OfflineDataset

    assert isinstance(offline, OfflineDataset)
    head = load_target_head(toy_target_dir)
    assert head.final_norm is not None
    lines: list[str] = []
    again = write_offline_dataset(
        shards, head.final_norm, offline.root, val_fraction=VAL_FRACTION, max_val=512,
        states_dtype=torch.float32, log=lines.append,
    )  # fmt: skip
    assert again == offline and any("reusing" in line for line in lines)
    other = write_offline_dataset(
        shards, head.final_norm, offline.root.with_name("other"), val_fraction=0.5, max_val=512,
        states_dtype=torch.float32, log=print,
    )  # fmt: skip
    assert other.key != offline.key and other.train_samples != offline.train_samples


def test_the_launch_flags_resolve_to_speculators_defaults_but_the_matched_settings(tmp_path: Path) -> None:
    from speculators.train.config import TrainConfig

    settings = SpeculatorsSettings(
        verifier=tmp_path / "target",
        data=tmp_path / "data",
        d2t=tmp_path / "d2t.npy",
        t2d=tmp_path / "t2d.npy",
        draft_vocab_size=1024,
        epochs=2,
        ttt_steps=5,
        total_seq_len=512,
        train_data_ratio=0.95,
        target_layer_ids=(2, 4, 5),
        hidden_states_dtype="float32",
        loss_implementation="eager",
        num_workers=0,
    )
    cfg = TrainConfig.resolve(settings.flags(tmp_path / "ck", tmp_path / "logs")).flatten()
    matched = {
        "epochs": 2, "ttt_steps": 5, "total_seq_len": 512, "draft_vocab_size": 1024, "train_data_ratio": 0.95,
        "target_layer_ids": [2, 4, 5], "draft_attn_impl": "sdpa", "hidden_states_dtype": "float32",
        "loss_implementation": "eager", "num_workers": 0, "on_missing": "raise",
    }  # fmt: skip
    assert {k: cfg[k] for k in matched} == matched
    # what is not matched stays at speculators' defaults (the recipe the comparison is about)
    defaults = {
        "optimizer": "muon", "lr": 1e-3, "muon_lr": 1e-3, "loss_fn": "kl_div", "scheduler_type": "linear",
        "ttt_step_loss_decay": 1.0, "norm_before_fc": True, "norm_output": True, "norm_before_residual": True,
        "num_layers": 1, "embed_requires_grad": False, "seed": 42,
    }  # fmt: skip
    assert {k: cfg[k] for k in defaults} == defaults


def test_eagle3_overrides_nest_dotted_keys_and_read_yaml_values() -> None:
    assert eagle3_overrides(["lr=3e-4", "variant.norm_output=true", "grad_clip=null"]) == {
        "lr": 3e-4,
        "variant": {"norm_output": True},
        "grad_clip": None,
    }
    for bad in ("epochs=3", "max_len=128", "val_fraction=0", "lr"):
        with pytest.raises(ConfigError, match="--eagle3-set"):
            eagle3_overrides([bad])


def test_the_matched_fields_win_and_a_bad_override_is_refused_up_front() -> None:
    args = parse_args(
        ["--epochs", "2", "--ttt-steps", "4", "--draft-vocab", "512", "--eagle3-set", "lr=5e-4"]
    )
    cfg = eagle3_train_config(args, "cpu")
    assert (cfg.epochs, cfg.ttt_steps, cfg.draft_vocab_size, cfg.max_len, cfg.device, cfg.lr) == (
        2,
        4,
        512,
        512,
        "cpu",
        5e-4,
    )
    with pytest.raises(ConfigError, match="no_such_field"):
        eagle3_train_config(parse_args(["--eagle3-set", "no_such_field=1"]), "cpu")
