"""`eagle3 materialize` in process (no webserver) and `eagle3 status` on the toy target, through the console
script's main(): one shard by hand, a run left STARTED by a process that died, then `--missing` fails that
run and materializes exactly the shards not done, each once, and a second `--missing` has nothing to do.
Shards `eagle3 extract` made outside Dagster are recorded from the store, not extracted again."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from eagle3_cli.main import main
from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.store.held import held_shard
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.stats import shard_done, store_stats
from eagle3_dagster.materialize import RUNNER_TAG, add_shard_partitions
from tests.conftest import write_config
from tests.kill import eagle3, every_crash_point

pytestmark = pytest.mark.filterwarnings("ignore:Specifying a partitions_def:dagster.PreviewWarning")


def _status(config: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    capsys.readouterr()
    assert main(["--config", str(config), "status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    return {row["key"]: row for row in report["shards"]}


def _project(directory: Path, toy_target_dir: Path, limit: int = 40) -> Path:
    return write_config(
        directory,
        "store: store\ndata: {dataset: mm, shard_size: 8, holdout_fraction: 0.0, "
        f"sources: [{{kind: chitchat, limit: {limit}}}]}}\n"
        f"target: {{path: {toy_target_dir}}}\nregenerate: {{enabled: false}}\ntokenize: {{max_seq_len: 96}}\n",
    )


def test_materialize_missing_in_process(
    tmp_path: Path, toy_target_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _project(tmp_path, toy_target_dir)
    keys = ingest(load_config(config)).all_shards
    assert len(keys) >= 3, keys
    # the instance: .dagster beside the config (the CLI's rule without $DAGSTER_HOME); restored afterwards
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("EAGLE3_CONFIG", raising=False)
    home = tmp_path / ".dagster"

    assert set(s["state"] for s in _status(config, capsys).values()) == {"missing"}
    assert (home / "dagster.yaml").exists()
    assert main(["--config", str(config), "materialize", "--in-process", "--shards", keys[0]]) == 0
    assert f"shard {keys[0]}: materialized" in capsys.readouterr().out

    # a run the instance has as STARTED, for the second shard, whose process is gone
    proc = subprocess.Popen(["true"])
    proc.wait()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        add_shard_partitions(instance, keys)
        dead = create_run_for_test(
            instance,
            status=dg.DagsterRunStatus.STARTED,
            tags={RUNNER_TAG: f"{socket.gethostname()}:{proc.pid}:1", "dagster/partition": keys[1]},
        )
    states = _status(config, capsys)
    assert [states[k]["state"] for k in keys] == [
        "materialized",
        "interrupted",
        *["missing"] * (len(keys) - 2),
    ]

    assert main(["--config", str(config), "materialize", "--missing", "--in-process"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"run {dead.run_id} ({keys[1]}): process gone, marked failed" in out
    assert f"{len(keys) - 1} shard(s) to materialize: {', '.join(keys[1:])}" in out
    assert f"{len(keys) - 1} shard(s) materialized in process" in out

    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.FAILURE  # type: ignore[union-attr]
        records = instance.fetch_materializations(dg.AssetKey("hidden_states"), limit=100).records
        assert sorted(str(r.partition_key) for r in records) == sorted(keys)  # each shard once
        runs = {r.run_id: r for r in instance.get_runs()}
        assert all(RUNNER_TAG in runs[r.run_id].tags for r in records)  # each tagged with its process

    assert main(["--config", str(config), "materialize", "--missing", "--in-process"]) == 0
    assert "nothing to materialize" in capsys.readouterr().out
    states = _status(config, capsys)
    figures = {row.key: row.values for row in store_stats(tmp_path / "store").shards}
    assert {k: s["state"] for k, s in states.items()} == dict.fromkeys(keys, "materialized")
    assert {k: s["samples"] for k, s in states.items()} == {k: figures[k]["samples"] for k in keys}
    assert main(["--config", str(config), "materialize"]) == 2  # neither --missing nor --shards


def test_shards_eagle3_extract_made_are_recorded_not_extracted_again(
    tmp_path: Path, toy_target_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _project(tmp_path, toy_target_dir)
    keys = ingest(load_config(config)).all_shards
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("EAGLE3_CONFIG", raising=False)
    outside = keys[:2]
    assert main(["--config", str(config), "extract", *(f"--shard={k}" for k in outside)]) == 0
    layout = StoreLayout(tmp_path / "store")

    def identity(key: str) -> tuple[int, int]:
        st = layout.hidden_states(key).stat()
        return st.st_ino, st.st_mtime_ns

    extracted = {k: identity(k) for k in outside}
    states = _status(config, capsys)
    assert [states[k]["state"] for k in keys] == ["unrecorded"] * 2 + ["missing"] * (len(keys) - 2)

    assert main(["--config", str(config), "materialize", "--missing", "--in-process"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"2 shard(s) the store holds recorded as materialized, not run again: {', '.join(outside)}" in out
    assert f"{len(keys) - 2} shard(s) to materialize: {', '.join(keys[2:])}" in out
    assert {k: identity(k) for k in outside} == extracted  # the very files eagle3 extract wrote

    with dg.DagsterInstance.from_config(str(tmp_path / ".dagster")) as instance:
        records = instance.fetch_materializations(dg.AssetKey("hidden_states"), limit=100).records
        assert sorted(str(r.partition_key) for r in records) == sorted(keys)  # each shard once
        assert {str(r.partition_key) for r in records if r.run_id == ""} == set(outside)  # recorded, runless
    assert {s["state"] for s in _status(config, capsys).values()} == {"materialized"}


@pytest.mark.parametrize("made_by", ["materialize", "extract"])
def test_a_conversion_killed_at_any_rename_leaves_no_shard_missing_and_extracts_nothing(
    made_by: str,
    tmp_path: Path,
    toy_target_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`eagle3 convert-shards --to fp8_e4m3` SIGKILLed at each of its renames leaves the shard whole, in its old
    dtype (beside the converted temporary) or its new one (beside its old manifest, killed between the two):
    the store holds it, and `materialize --missing` finds nothing missing and extracts nothing, whether Dagster
    made the shard or `eagle3 extract` did (then it is recorded, what the conversion left finished first)."""
    project = tmp_path / "project"
    config = _project(project, toy_target_dir, limit=8)
    [key] = ingest(load_config(config)).all_shards
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("EAGLE3_CONFIG", raising=False)
    if made_by == "materialize":
        assert main(["--config", str(config), "materialize", "--in-process", "--shards", key]) == 0
    else:
        assert main(["--config", str(config), "extract", f"--shard={key}"]) == 0
    made = tmp_path / "made"  # the store and the instance (.dagster beside the config) before the conversion
    shutil.copytree(project, made)
    layout = StoreLayout(project / "store")
    shard = layout.hidden_states(key)

    def reset() -> None:
        shutil.rmtree(project)
        shutil.copytree(made, project)

    def check(n: int) -> None:
        identity = (shard.stat().st_ino, shard.stat().st_mtime_ns)
        capsys.readouterr()
        assert main(["--config", str(config), "materialize", "--missing", "--in-process"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "nothing to materialize" in out, (n, out)
        assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == identity, n  # not extracted again
        assert _status(config, capsys)[key]["state"] == "materialized", n
        assert held_shard(layout.root, key) is not None and shard_done(layout.root, key), n
        assert store_stats(layout.root).incomplete == [], n

    convert = ("--config", str(config), "convert-shards", "--to", "fp8_e4m3")
    assert every_crash_point(eagle3, convert, reset, check) >= 2  # the new shard's rename, its manifest's
