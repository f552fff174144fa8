"""The data and vocabulary checks run by Dagster, on one shard extracted from a real (tiny, random) target."""

import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import read_header
from eagle3_dagster.defs.data.checks import SHARD_CHECKS, shard_complete, shard_integrity
from eagle3_dagster.defs.drafter.assets import vocab_mapping
from eagle3_dagster.defs.drafter.checks import vocab_coverage
from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
from eagle3_dagster.materialize import SHARD_ASSETS, add_shard_partitions
from tests.conftest import FIXTURES, write_config
from tests.helpers import save_tiny_chat_target

pytestmark = pytest.mark.filterwarnings("ignore::dagster.PreviewWarning")


def _evaluations(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def test_shard_checks_through_dagster_and_a_corrupted_shard_fails_integrity(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    target_dir = save_tiny_chat_target(tmp_path / "target")
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    config_path = write_config(
        tmp_path,
        f"store: store\ndata: {{dataset: fx, holdout_fraction: 0.0, sources: [{{path: rows.jsonl}}]}}\n"
        f"target: {{path: {target_dir}}}\n"
        "regenerate: {max_new_tokens: 6, batch_size: 4}\ntokenize: {max_seq_len: 256}\n"
        "train: {draft_vocab_size: 4}\nchecks: {max_reject_rate: 0.25, min_vocab_coverage: 0.999}\n",
    )
    cfg = load_config(config_path)
    [key] = ingest(cfg).all_shards
    add_shard_partitions(instance, [key])
    eagle3 = Eagle3Resource(config_path=str(config_path))
    resources = {"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)}

    result = dg.materialize(
        [*SHARD_ASSETS, *SHARD_CHECKS], partition_key=key, instance=instance, resources=resources
    )
    assert result.success  # the reject rate fails, but only warns
    checks = _evaluations(result)
    assert set(checks) == {"shard_complete", "shard_integrity", "reject_rate"}
    assert all(e.partition == key for e in checks.values())
    complete = checks["shard_complete"]
    assert complete.passed and complete.asset_key == dg.AssetKey("hidden_states")
    assert complete.metadata["accounted"].value == complete.metadata["train_conversations"].value == 4
    assert checks["shard_integrity"].passed and checks["shard_integrity"].metadata["problems"].value == 0
    rejects = checks["reject_rate"]
    assert not rejects.passed and rejects.severity == dg.AssetCheckSeverity.WARN
    assert rejects.asset_key == dg.AssetKey("conversations")
    assert rejects.metadata["reject_rate"].value == pytest.approx(0.5)  # 5 of 10 rows, the duplicate ignored
    assert rejects.metadata["max_reject_rate"].value == 0.25

    # the vocabulary over that shard: its coverage with K=4 is under the 0.999 asked, which warns only
    result = dg.materialize(
        [*SHARD_ASSETS, vocab_mapping, vocab_coverage],
        selection=[vocab_mapping],
        instance=instance,
        resources=resources,
    )
    assert result.success
    [materialization] = result.get_asset_materialization_events()
    coverage = _evaluations(result)["vocab_coverage"]
    assert not coverage.passed and coverage.severity == dg.AssetCheckSeverity.WARN
    recorded = materialization.step_materialization_data.materialization.metadata["coverage"].value
    assert coverage.metadata["coverage"].value == pytest.approx(recorded)
    assert coverage.metadata["draft_vocab_size"].value == 4

    # one flipped byte in the shard's data: the checks alone, re-run on that partition, fail integrity. (A
    # checks-only selection has no asset to take a partitions definition from, so the partition goes as a tag.)
    shard = StoreLayout(cfg.store_root).hidden_states(key)
    _, data_start = read_header(shard)
    raw = bytearray(shard.read_bytes())
    raw[data_start + (len(raw) - data_start) // 2] ^= 0x10  # inside the hidden states
    shard.write_bytes(bytes(raw))
    recheck = dg.define_asset_job(
        "recheck", selection=dg.AssetSelection.checks(shard_complete, shard_integrity)
    )
    job = dg.Definitions(
        assets=SHARD_ASSETS, asset_checks=SHARD_CHECKS, jobs=[recheck], resources=resources
    ).resolve_job_def("recheck")
    result = job.execute_in_process(tags={"dagster/partition": key}, instance=instance, raise_on_error=False)
    assert not result.success  # a blocking check failed
    assert result.get_asset_materialization_events() == []  # nothing was re-extracted
    checks = _evaluations(result)
    assert checks["shard_complete"].passed  # every file is there and the counts add up
    integrity = checks["shard_integrity"]
    assert (
        not integrity.passed
        and integrity.severity == dg.AssetCheckSeverity.ERROR
        and integrity.partition == key
    )
    assert integrity.metadata["problems"].value >= 1 and "checksum" in (integrity.description or "")
