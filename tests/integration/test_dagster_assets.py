"""The three data assets materialised in process, on a real (tiny, random) transformers target."""

import shutil
from pathlib import Path

import dagster as dg
import pytest

from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.store.shards import ShardReader
from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
from eagle3_dagster.materialize import SHARD_ASSETS, add_shard_partitions
from tests.conftest import FIXTURES, write_config
from tests.helpers import save_tiny_chat_target


def test_materialize_one_shard_through_all_three_assets(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    target_dir = save_tiny_chat_target(tmp_path / "target")
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    config_path = write_config(
        tmp_path,
        f"store: store\ndata: {{dataset: fx, holdout_fraction: 0.0, sources: [{{path: rows.jsonl}}]}}\n"
        f"target: {{path: {target_dir}}}\n"
        "regenerate: {max_new_tokens: 6, batch_size: 4}\ntokenize: {max_seq_len: 256}\n",
    )
    cfg = load_config(config_path)
    [key] = ingest(cfg).all_shards
    assert add_shard_partitions(instance, [key]) == [key]
    eagle3 = Eagle3Resource(config_path=str(config_path))
    result = dg.materialize(
        SHARD_ASSETS,
        partition_key=key,
        instance=instance,
        resources={"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)},
    )
    assert result.success
    meta = {
        m.asset_key.path[-1]: m.metadata
        for m in (
            e.step_materialization_data.materialization for e in result.get_asset_materialization_events()
        )
    }
    conv = meta["conversations"]
    assert conv["samples"].value == 4  # rows 1, 7 (a prompt: regeneration answers it), 9, 11
    assert conv["rejected"].value == 6
    assert conv["rejected_invalid_utf8"].value == 1 and conv["rejected_duplicate"].value == 1
    regen = meta["regenerated"]
    assert regen["samples"].value + regen["errors"].value == 4
    hidden = meta["hidden_states"]
    assert hidden["samples"].value == regen["samples"].value
    assert hidden["tokens"].value > hidden["loss_tokens"].value > 0
    for field in ("bytes", "tokens_per_second", "truncated_samples", "errors", "path"):
        assert field in hidden, field
    with ShardReader(Path(hidden["path"].value)) as shard:
        assert len(shard) == hidden["samples"].value
        assert shard.verify() == []


@pytest.mark.parametrize("bad", ["data: {shard_size: -1}\n"])
def test_a_bad_config_fails_the_run_with_the_field_named(
    tmp_path: Path, bad: str, instance: dg.DagsterInstance
) -> None:
    config_path = write_config(tmp_path, bad)
    add_shard_partitions(instance, ["chat-00000"])
    eagle3 = Eagle3Resource(config_path=str(config_path))
    result = dg.materialize(
        SHARD_ASSETS[:1],
        partition_key="chat-00000",
        instance=instance,
        resources={"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)},
        raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "data.shard_size" in str(failure.event_specific_data)
