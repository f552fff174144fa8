"""The Dagster UI in a real browser: `dagster dev` on 127.0.0.1 and Debian's headless Chromium, driven by Playwright.

Open the asset graph, launch Materialize for one missing shard from the data group's page (the partition
dialog, one key picked), wait for the run to succeed, and read that shard's `errors` metadata on
hidden_states' partition page, checked against what the instance recorded. Screenshots of every step go to
test-artifacts/ui/ at the repository root, with the server's log. Without Chromium or the playwright package
the test is skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_dagster.materialize import SHARD_ASSETS, add_shard_partitions
from tests.conftest import REPO, in_ci, write_config
from tests.dagster_dev import (  # noqa: F401 (dagster_dev_factory is a fixture)
    DagsterDev,
    dagster_dev_factory,
    dagster_home,
    free_port,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
EAGLE3 = Path(sys.executable).parent / "eagle3"  # the console script, as `make demo` prints it
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "test-artifacts" / "ui"
LOCATION = "eagle3_dagster.definitions"
TIMEOUT_MS = 60_000  # the UI is a React app served by one Python process; on 2 busy cores it is slow
RUN_TIMEOUT_S = 300
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}
IN_PROCESS = "execution:\n  config:\n    in_process: {}\n"

RUN_QUERY = """
query Run($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId status runConfigYaml tags { key value } assetSelection { path } }
  }
}
"""
RUNS_QUERY = "{ runsOrError { ... on Runs { results { runId status tags { key value } } } } }"
RUN_LOGS_QUERY = """
query Logs($runId: ID!) {
  logsForRun(runId: $runId) {
    ... on EventConnection {
      events {
        __typename
        ... on MessageEvent { message stepKey }
        ... on ExecutionStepFailureEvent { error { message stack } }
      }
    }
  }
}
"""


def _unavailable(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CI=true and the UI test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Debian's Chromium, headless, through Playwright (never `playwright install`: no browser download)."""
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is missing (pip install -e '.[dev]')")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Screenshots:
    """Numbered full-page screenshots under test-artifacts/ui/ (emptied at the start of the test)."""

    def __init__(self, page: Page, directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.page = page
        self.directory = directory
        self.count = 0

    def __call__(self, name: str) -> Path:
        self.count += 1
        path = self.directory / f"{self.count:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


def _ingest_shards(tmp_path: Path, target: Path) -> tuple[Path, list[str]]:
    """Three small shards (up to 20 conversations each) of chitchat, no regeneration (rows without an
    assistant turn are rejected); max_seq_len is small enough that tokenisation drops some conversations (no
    loss token left), so a shard's `errors` is not just 0."""
    config_path = write_config(
        tmp_path,
        "store: store\n"
        "data: {dataset: ui, shard_size: 20, holdout_fraction: 0.0, "
        "sources: [{kind: chitchat, limit: 80}]}\n"
        f"target: {{path: {target}}}\n"
        "regenerate: {enabled: false}\n"
        "tokenize: {max_seq_len: 32}\n"
        "extract: {max_batch_tokens: 2048}\n",
    )
    report = ingest(load_config(config_path))
    return config_path, report.all_shards


def _wait_for_run(dev: DagsterDev, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        run = dev.graphql(RUN_QUERY, {"runId": run_id})["runOrError"]
        if run["__typename"] == "Run" and run["status"] in TERMINAL:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"run {run_id} still {run.get('status')} after {RUN_TIMEOUT_S} s:\n{dev.log_tail()}")
        time.sleep(1.0)
    if run["status"] != "SUCCESS":
        events = dev.graphql(RUN_LOGS_QUERY, {"runId": run_id})["logsForRun"].get("events", [])
        messages = [e.get("error") or e.get("message") for e in events][-20:]
        pytest.fail(f"run {run_id} ended {run['status']}:\n" + "\n".join(map(str, messages)))
    result: dict[str, Any] = run
    return result


def _launched_run(dev: DagsterDev, key: str) -> str:
    """The run the dialog launched, found through GraphQL: the only run tagged as launched from the UI."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runs = [
            run
            for run in dev.graphql(RUNS_QUERY)["runsOrError"]["results"]
            if {"key": "dagster/from_ui", "value": "true"} in run["tags"]
        ]
        if runs:
            assert len(runs) == 1, runs
            tags = {t["key"]: t["value"] for t in runs[0]["tags"]}
            assert tags.get("dagster/partition") == key, tags
            run_id: str = runs[0]["runId"]
            return run_id
        time.sleep(0.5)
    pytest.fail(f"no run was launched within 60 s:\n{dev.log_tail()}")


def test_materialize_one_shard_from_the_ui(
    browser: Browser,
    tmp_path: Path,
    toy_target_dir: Path,
    dagster_dev_factory: Callable[..., DagsterDev],  # noqa: F811 (the fixture imported above)
) -> None:
    config_path, shards = _ingest_shards(tmp_path, toy_target_dir)
    assert len(shards) >= 2, shards
    key = shards[1]  # one missing shard, not the first in the list
    home = dagster_home(tmp_path)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert add_shard_partitions(instance, shards) == shards
    dev = dagster_dev_factory(home, config_path)
    # The UI opens a "Join the Dagster community" dialog on localhost, once, about a second after some page
    # loads, over whatever dialog is open then: mark it seen on the server, as its Skip button does.
    assert dev.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True

    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.set_default_navigation_timeout(TIMEOUT_MS)
    shot = Screenshots(page, ARTIFACTS)
    try:
        # 1. The global asset graph: the three groups.
        page.goto(dev.url("/asset-groups"))
        page.get_by_text("Global asset lineage").wait_for()
        for group in ("data", "drafter", "evaluation"):
            page.get_by_text(group, exact=True).first.wait_for()
        shot("asset-graph")

        # 2. The data group's graph: conversations -> regenerated -> hidden_states.
        page.goto(dev.url(f"/locations/{LOCATION}/asset-groups/data"))
        for name in ("conversations", "regenerated", "hidden_states"):
            page.get_by_text(name, exact=True).first.wait_for()
        shot("data-group")

        # 3. Materialize all (the three shard assets) for one partition: Custom, pick the key, Launch 1 run.
        page.get_by_role("button", name=re.compile(r"Materialize all")).click()
        dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize")
        dialog.get_by_text("Launch runs to materialize 3 assets").wait_for()
        dialog.get_by_text("Select a partition or create one").click()
        page.get_by_placeholder("Filter partitions").fill(key)
        page.get_by_role("menuitem", name=key).click()  # the filter leaves one (strict: two would fail)
        page.keyboard.press("Escape")  # closes the partition list, not the dialog
        dialog.get_by_text("1 partition", exact=True).wait_for()
        # Run config, through the dialog's config editor: the steps in process. The default (one subprocess
        # per step, each importing torch, and the shard checks add three steps) takes minutes on 2 cores.
        dialog.get_by_text("Config", exact=True).click()
        dialog.get_by_role("button", name="Add config").click()
        editor = page.get_by_role("dialog").filter(has_text="Config Editor")
        editor.locator(".CodeMirror").click()
        # Inserted as one input: typed key by key, the editor would auto-indent and close braces.
        page.keyboard.insert_text(IN_PROCESS)
        editor.get_by_text("No errors").wait_for()
        editor.get_by_role("button", name="Save config").click()
        dialog.get_by_text("Config saved").wait_for()
        editor.wait_for(state="hidden")
        launch = dialog.get_by_role("button", name="Launch 1 run")
        launch.wait_for()
        shot("launch-dialog")
        launch.click()

        # 4. The run: the toast's View opens its page; wait for success (GraphQL), then see it there.
        run_id = _launched_run(dev, key)
        toast = page.get_by_text(re.compile(r"Launched run"))
        try:
            toast.wait_for(timeout=15_000)
            shot("launched")
            page.get_by_role("button", name="View", exact=True).click(timeout=10_000)
            page.wait_for_url(re.compile(rf"/runs/{run_id}"), timeout=30_000)
        except Exception:  # the toast is gone already on a slow machine: open the run's page directly
            page.goto(dev.url(f"/runs/{run_id}"))
        run = _wait_for_run(dev, run_id)
        assert sorted(a["path"][-1] for a in run["assetSelection"]) == sorted(
            a.key.path[-1] for a in SHARD_ASSETS
        )
        assert "in_process" in run["runConfigYaml"], run["runConfigYaml"]
        page.reload()
        page.get_by_text("Success", exact=True).first.wait_for()
        page.get_by_text(f"partition: {key}").first.wait_for()
        page.get_by_text("Loading run logs").wait_for(state="hidden")
        shot("run-succeeded")

        # 5. hidden_states' Partitions tab, the shard selected: its materialization's metadata table.
        page.goto(dev.url(f"/assets/hidden_states?view=partitions&partition={key}"))
        page.get_by_role("tab", name="Partitions").wait_for()
        page.get_by_text("Materialized (1)").wait_for()
        page.get_by_text(f"Missing ({len(shards) - 1})").wait_for()
        errors_row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="errors", exact=True))
        errors_row.wait_for()
        cells = errors_row.get_by_role("cell").all_inner_texts()
        path_row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="path", exact=True))
        assert f"{key}.safetensors" in path_row.inner_text()  # this shard's materialization, not another's
        errors_row.scroll_into_view_if_needed()
        shot("partition-metadata")
    except BaseException:
        with suppress(Exception):  # keep what the page showed, without hiding the failure itself
            shot("failure")
            (ARTIFACTS / "failure.html").write_text(page.content())
        print(dev.log_tail())
        raise
    finally:
        context.close()
        shutil.copy(dev.log_path, ARTIFACTS / "dagster-dev.log")

    shown = int(cells[1].strip())
    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("hidden_states"), asset_partitions=[key]), limit=1
        ).records
        assert len(records) == 1
        materialization = records[0].asset_materialization
        assert materialization is not None and materialization.partition == key
        recorded = materialization.metadata["errors"].value
        assert shown == recorded, (shown, recorded)
        assert recorded > 0  # some conversations were dropped at tokenisation (max_seq_len 32)
        # Only that shard was materialized, by the one run, through all three shard assets, and nothing else.
        for asset in SHARD_ASSETS:
            assert instance.get_materialized_partitions(asset.key) == {key}, asset.key
        assert instance.get_latest_materialization_event(dg.AssetKey("vocab_mapping")) is None
        # The one run materialized the shard; nothing else (the automation sensor waits for every shard).
        assert [r.run_id for r in instance.get_runs() if r.tags.get("dagster/partition")] == [run_id]


def test_the_eagle3_ui_command_serves_the_asset_graph(
    browser: Browser, tmp_path: Path, toy_target_dir: Path
) -> None:
    """The command `make demo` tells the user to run, as the console script, opens the graph in Chromium."""
    config_path, _ = _ingest_shards(tmp_path, toy_target_dir)
    port = free_port()
    log_path = tmp_path / "eagle3-ui.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [str(EAGLE3), "--config", str(config_path), "ui", "--port", str(port)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stop() ends dagster dev's daemon and code server too
        )
    dev = DagsterDev(proc, f"http://127.0.0.1:{port}", log_path, tmp_path / ".dagster")
    try:
        dev.wait_until_ready()
        assert dev.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True
        assert f"Dagster UI: http://127.0.0.1:{port}" in log_path.read_text()
        # The instance is the one beside the config, as the command's line says.
        assert (tmp_path / ".dagster" / "dagster.yaml").exists()
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(dev.url("/asset-groups"))
        page.get_by_text("Global asset lineage").wait_for()
        for group in ("data", "drafter", "evaluation"):
            page.get_by_text(group, exact=True).first.wait_for()
        page.goto(dev.url(f"/locations/{LOCATION}/asset-groups/data"))
        for name in ("conversations", "regenerated", "hidden_states"):
            page.get_by_text(name, exact=True).first.wait_for()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "eagle3-ui-command.png"), full_page=True)
        page.close()
    finally:
        dev.stop()
    assert proc.poll() is not None
