"""A store's shards re-encoded in another store dtype through Dagster (job eagle3_convert_shards), in process:
a shard a real (tiny, random) target extracted in bfloat16 through the shard assets becomes FP8 with the same
samples, its blocking checks evaluated on the new file; a second run converts nothing; a shard the store does
not hold fails its run in one line; a dtype that is not one is refused at launch, nothing run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import dagster as dg
import pytest
import torch

from eagle3_core.config import ExtractConfig, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.store.fp8 import dequantize, quantize
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import ShardReader, read_shard_header
from eagle3_dagster.defs.data.assets import CONVERTED_TAG, StoreDtype, hidden_states
from eagle3_dagster.defs.data.checks import SHARD_CHECKS
from eagle3_dagster.defs.data.convert import CONVERT_JOB, convert_job
from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
from eagle3_dagster.materialize import SHARD_ASSETS, add_shard_partitions, missing_shards
from tests.conftest import write_config
from tests.helpers import save_tiny_chat_target

pytestmark = pytest.mark.filterwarnings("ignore::dagster.PreviewWarning")


def _contents(shard: Path) -> dict[str, Any]:
    with ShardReader(shard) as reader:
        samples = [reader.sample(i) for i in range(len(reader))]
        return {
            "store_dtype": read_shard_header(shard).store_dtype,
            "sample_ids": reader.sample_ids,
            "failed": reader.meta.failed,
            "tokens": [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples],
            "aux": [s.aux_hidden_states for s in samples],
            "last": [s.last_hidden_states for s in samples],
            "problems": reader.verify(),
        }


def _materialization(result: dg.ExecuteInProcessResult) -> dg.AssetMaterialization:
    [event] = result.get_asset_materialization_events()  # hidden_states alone: nothing upstream made again
    return event.step_materialization_data.materialization


def _values(materialization: dg.AssetMaterialization) -> dict[str, Any]:
    return {k: v.value for k, v in materialization.metadata.items()}


def _fp8(states: torch.Tensor, groups: int) -> torch.Tensor:
    return dequantize(*quantize(states, groups))


def test_the_convert_job_reencodes_a_shard_in_fp8_and_a_second_run_converts_nothing(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    target_dir = save_tiny_chat_target(tmp_path / "target")
    config_path = write_config(
        tmp_path,
        "store: store\ndata: {dataset: cv, shard_size: 4, holdout_fraction: 0.0, "
        "sources: [{kind: chitchat, limit: 16}]}\n"
        f"target: {{path: {target_dir}}}\nregenerate: {{enabled: false}}\ntokenize: {{max_seq_len: 128}}\n",
    )
    cfg = load_config(config_path)
    keys = ingest(cfg).all_shards
    assert len(keys) >= 2, keys
    extracted, not_extracted = keys[:2]
    add_shard_partitions(instance, keys)
    eagle3 = Eagle3Resource(config_path=str(config_path))
    resources = {"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)}
    made = dg.materialize(
        [*SHARD_ASSETS, *SHARD_CHECKS], partition_key=extracted, instance=instance, resources=resources
    )
    assert made.success
    shard = StoreLayout(cfg.store_root).hidden_states(extracted)
    before = _contents(shard)
    assert before["store_dtype"] == "bfloat16" and len(before["sample_ids"]) > 0
    job = dg.Definitions(
        assets=SHARD_ASSETS, asset_checks=SHARD_CHECKS, jobs=[convert_job], resources=resources
    ).resolve_job_def(CONVERT_JOB)

    result = job.execute_in_process(partition_key=extracted, instance=instance)  # the job's default: FP8
    assert result.success
    materialization = _materialization(result)
    assert (materialization.asset_key, materialization.partition) == (hidden_states.key, extracted)
    assert (materialization.tags or {})[CONVERTED_TAG] == "fp8_e4m3"
    meta = _values(materialization)
    assert meta["converted"] is True and meta["newly_failed"] == 0 and meta["seconds"] >= 0
    assert (meta["converted_from"], meta["store_dtype"]) == ("bfloat16", "fp8_e4m3")
    assert meta["bytes_after"] == meta["bytes"] == shard.stat().st_size < meta["bytes_before"] * 0.75
    assert meta["samples"] == len(before["sample_ids"]) and meta["path"] == str(shard)
    # the blocking checks ran on the converted shard, against this materialization
    [latest] = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=hidden_states.key, asset_partitions=[extracted]), limit=1
    ).records
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert set(checks) == {"shard_complete", "shard_integrity"}
    for evaluation in checks.values():
        assert evaluation.passed and evaluation.partition == extracted
        assert evaluation.target_materialization_data is not None
        assert evaluation.target_materialization_data.storage_id == latest.storage_id

    after = _contents(shard)
    assert after["store_dtype"] == "fp8_e4m3" and after["problems"] == []
    for field in ("sample_ids", "failed", "tokens"):
        assert after[field] == before[field], field
    aux_groups = len(read_shard_header(shard).aux_layer_ids or [])
    for name, groups in (("aux", aux_groups), ("last", 1)):
        for got, was in zip(after[name], before[name], strict=True):
            assert torch.equal(got, _fp8(was, groups)), name  # the bfloat16 states, quantised once
    # the store dtype the config extracts in is not what makes a shard missing: nothing is extracted again
    fp8_cfg = load_config(config_path, "extract: {store_dtype: fp8_e4m3}")
    assert missing_shards(instance, fp8_cfg, [extracted, not_extracted]) == [not_extracted]

    identity = (shard.stat().st_ino, shard.stat().st_mtime_ns)
    again = job.execute_in_process(partition_key=extracted, instance=instance)
    assert again.success
    meta = _values(_materialization(again))
    assert meta["converted"] is False and meta["store_dtype"] == meta["converted_from"] == "fp8_e4m3"
    assert meta["bytes_before"] == meta["bytes_after"] == shard.stat().st_size
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == identity  # not rewritten

    absent = job.execute_in_process(partition_key=not_extracted, instance=instance, raise_on_error=False)
    assert not absent.success and absent.get_asset_materialization_events() == []
    failure = next(e for e in absent.all_events if e.is_step_failure)
    assert f"{not_extracted}: no hidden-state shard to convert" in str(failure.event_specific_data)

    runs = instance.get_runs_count()
    with pytest.raises(dg.DagsterInvalidConfigError) as refused:
        job.execute_in_process(
            partition_key=extracted,
            instance=instance,
            run_config={"ops": {"hidden_states": {"config": {"convert_to": "fp9"}}}},
        )
    # Dagster's header, then one line naming the field and the value (the launchpad offers the enum's values)
    field = "root:ops:hidden_states:config:convert_to"
    assert [ln.strip() for ln in str(refused.value).splitlines()] == [
        f"Error in config for job {CONVERT_JOB}",
        f"Error 1: Value at path {field} not in enum type StoreDtype got fp9",
    ]
    assert instance.get_runs_count() == runs  # refused before any run
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == identity


def test_the_dtypes_dagster_offers_are_the_configs() -> None:
    offered = {d.value for d in StoreDtype}
    assert offered == set(get_args(ExtractConfig.model_fields["store_dtype"].annotation))
