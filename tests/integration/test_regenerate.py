"""In-process regeneration on a real (tiny, random) transformers target."""

import json
from pathlib import Path

import pytest

from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest, load_conversation_shard
from eagle3_core.steps.data import regenerate_step
from eagle3_core.store.atomic import read_jsonl
from eagle3_core.store.layout import StoreLayout
from eagle3_core.targets.hf import TransformersTarget
from tests.conftest import write_config
from tests.helpers import save_tiny_chat_target


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TransformersTarget]:
    root = tmp_path_factory.mktemp("regen")
    target_dir = save_tiny_chat_target(root / "target")
    with open(root / "c.jsonl", "w") as f:
        for i in range(10):
            turns = [
                {"role": "user", "content": f"hello number {i}"},
                {"role": "assistant", "content": "original reply"},
            ]
            turns += [{"role": "user", "content": "tell me more"}] * (i % 2)  # odd rows end with a user turn
            f.write(json.dumps({"messages": turns}) + "\n")
    config = write_config(
        root,
        f"store: store\ndata: {{dataset: r, holdout_fraction: 0.2, sources: [{{path: c.jsonl}}]}}\n"
        f"target: {{path: {target_dir}}}\nregenerate: {{max_new_tokens: 5, batch_size: 3}}\n",
    )
    cfg = load_config(config)
    ingest(cfg)
    return config, TransformersTarget(target_dir, cfg.target)


def test_every_assistant_turn_is_the_targets_and_ids_are_kept(setup: tuple[Path, TransformersTarget]) -> None:
    config, target = setup
    cfg = load_config(config)
    samples, _ = load_conversation_shard(cfg.store_root, "r-00000")
    train = [s for s in samples if s.split == "train"]
    result = regenerate_step(cfg, "r-00000", target)
    rows = read_jsonl(result.path)
    assert [r["id"] for r in rows] == [s.id for s in train]  # keyed by sample id: none skipped, none doubled
    assert result.metadata["heldout_skipped"] == len(samples) - len(train)
    for row, original in zip(rows, train, strict=True):
        if "error" in row:
            continue
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert users == [m.content for m in original.messages if m.role == "user"][: len(users)]
        assistants = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert "original reply" not in assistants
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * len(users)
    # a prompt that ended with a user turn got its answer too
    assert any(r.get("turns_regenerated") == 2 for r in rows)


def test_greedy_regeneration_is_deterministic_and_atomic(setup: tuple[Path, TransformersTarget]) -> None:
    config, target = setup
    cfg = load_config(config)
    path = StoreLayout(cfg.store_root).regenerated("r-00000")
    first = regenerate_step(cfg, "r-00000", target).path.read_bytes()
    assert regenerate_step(cfg, "r-00000", target).path.read_bytes() == first
    assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_regenerated_shard_is_whole_with_its_manifest_or_absent(
    setup: tuple[Path, TransformersTarget], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while a redo writes the shard: neither the old shard beside the new manifest nor a
    half-written file is left, and the next run completes it."""
    import errno

    from eagle3_core.steps import data

    config, target = setup
    cfg = load_config(config)
    layout = StoreLayout(cfg.store_root)
    regenerate_step(cfg, "r-00000", target)
    reference = layout.regenerated("r-00000").read_bytes()

    def disk_full(path: Path, rows: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(data, "write_rows", disk_full)
    with pytest.raises(OSError, match="No space left"):
        regenerate_step(cfg, "r-00000", target)
    assert not layout.regenerated("r-00000").exists()  # not done: the next run redoes it
    assert [p.name for p in layout.regenerated("r-00000").parent.iterdir() if ".tmp-" in p.name] == []
    monkeypatch.undo()
    regenerate_step(cfg, "r-00000", target)
    assert layout.regenerated("r-00000").read_bytes() == reference
    assert json.loads(layout.regenerated_manifest("r-00000").read_text())["key"] == "r-00000"
