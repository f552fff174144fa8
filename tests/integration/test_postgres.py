"""The compose stack's instance (docker/dagster.yaml, PostgreSQL storage) against a real PostgreSQL server.

Debian's PostgreSQL is started on 127.0.0.1 for the module, DAGSTER_HOME holds docker/dagster.yaml unchanged
with its credential variables pointed at that server, and one shard is materialized through the instance:
conversations -> regenerated -> hidden_states, on a tiny random transformers target. What Dagster recorded is
then read back from PostgreSQL, by a fresh instance and by SQL.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
from eagle3_dagster.materialize import QUIET, SHARD_ASSETS, add_shard_partitions
from tests.conftest import FIXTURES, REPO, write_config
from tests.helpers import save_tiny_chat_target
from tests.postgres_server import PostgresServer, assert_postgres_queued_and_pooled

DOCKER_DAGSTER_YAML = REPO / "docker" / "dagster.yaml"


@pytest.fixture
def postgres_home(tmp_path: Path, postgres_database: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A DAGSTER_HOME whose dagster.yaml is docker/dagster.yaml, byte for byte, on a database of its own
    (`postgres_database`, tests/integration/conftest.py, with the server started once for the module)."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(DOCKER_DAGSTER_YAML, home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    yield home


def _query(server: PostgresServer, db_name: str, sql: str) -> list[tuple[object, ...]]:
    import psycopg2

    conn = psycopg2.connect(server.dsn(db_name))
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return list(cur.fetchall())
    finally:
        conn.close()


def test_docker_instance_config_is_postgres_queued_pooled_and_monitored(postgres_home: Path) -> None:
    with dg.DagsterInstance.from_config(str(postgres_home)) as instance:
        assert_postgres_queued_and_pooled(instance)
        assert type(instance.run_launcher).__name__ == "DefaultRunLauncher"


def test_one_shard_materialized_through_the_postgres_instance(
    tmp_path: Path, postgres: PostgresServer, postgres_home: Path
) -> None:
    target_dir = save_tiny_chat_target(tmp_path / "target")
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    config_path = write_config(
        tmp_path,
        f"store: store\ndata: {{dataset: fx, holdout_fraction: 0.0, sources: [{{path: rows.jsonl}}]}}\n"
        f"target: {{path: {target_dir}}}\n"
        "regenerate: {max_new_tokens: 6, batch_size: 4}\ntokenize: {max_seq_len: 256}\n",
    )
    [key] = ingest(load_config(config_path)).all_shards
    eagle3 = Eagle3Resource(config_path=str(config_path))
    with dg.DagsterInstance.get() as instance:  # from $DAGSTER_HOME, as the CLI and the demo load it
        assert add_shard_partitions(instance, [key]) == [key]
        result = dg.materialize(
            SHARD_ASSETS,
            partition_key=key,
            instance=instance,
            resources={"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)},
            run_config=QUIET,
        )
        assert result.success
        run_id = result.run_id
        hidden_path = next(
            e.step_materialization_data.materialization.metadata["path"].value
            for e in result.get_asset_materialization_events()
            if e.asset_key == dg.AssetKey("hidden_states")
        )

    # A new instance (new connections) reads it all back from the server.
    with dg.DagsterInstance.from_config(str(postgres_home)) as instance:
        assert instance.get_dynamic_partitions("shards") == [key]
        for asset in SHARD_ASSETS:
            assert instance.get_materialized_partitions(asset.key) == {key}, asset.key
        record = instance.get_run_record_by_id(run_id)
        assert record is not None and record.dagster_run.status == dg.DagsterRunStatus.SUCCESS
        latest = instance.get_latest_materialization_event(dg.AssetKey("hidden_states"))
        assert latest is not None and latest.asset_materialization is not None
        assert latest.asset_materialization.metadata["path"].value == hidden_path
        assert Path(str(hidden_path)).is_file()

    db_name = os.environ["DAGSTER_POSTGRES_DB"]
    rows = _query(
        postgres,
        db_name,
        "SELECT asset_key, partition FROM event_logs "
        f"WHERE dagster_event_type = 'ASSET_MATERIALIZATION' AND run_id = '{run_id}' ORDER BY id",
    )
    assert [(str(k), p) for k, p in rows] == [
        (dg.AssetKey(name).to_string(), key) for name in ("conversations", "regenerated", "hidden_states")
    ]
    [(status,)] = _query(postgres, db_name, f"SELECT status FROM runs WHERE run_id = '{run_id}'")
    assert status == "SUCCESS"
    [(count,)] = _query(
        postgres, db_name, f"SELECT count(*) FROM dynamic_partitions WHERE partition = '{key}'"
    )
    assert count == 1
