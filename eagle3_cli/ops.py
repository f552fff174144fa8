"""Operating the pipeline over one Dagster instance: `eagle3 status`, `eagle3 materialize`, `eagle3 ui`.

The instance is $DAGSTER_HOME, else `.dagster` beside the config file (created with the repository's
dagster.yaml), the rule `eagle3 demo` follows for its working directory. `materialize` launches a partition
backfill through the webserver's GraphQL API when one answers (its daemon runs it and the UI shows it), and
runs the shards in this process otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from eagle3_cli.steps import console
from eagle3_core.config import Eagle3Config, load_config, without_url_passwords
from eagle3_core.engines import http
from eagle3_core.errors import Eagle3Error
from eagle3_core.store.atomic import atomic_write_bytes
from eagle3_core.store.held import held_shard, store_shard_keys
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import ConversationManifest

if TYPE_CHECKING:
    import dagster as dg

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKSPACE = REPO_ROOT / "workspace.yaml"
DEFAULT_URL = "http://127.0.0.1:3000"
PROBE_TIMEOUT_S = 2.0
POLL_S = 2.0
SHARD_ASSET_NAMES = ("conversations", "regenerated", "hidden_states")
# A shard's state, from hidden_states' partition in the instance (Dagster's own partition status) and what the
# store holds (the truth): "interrupted" is a run for it STARTED whose in-process runner is gone (killed);
# "unrecorded" a shard the store holds that the instance does not know (extracted outside Dagster), which
# `materialize` records instead of extracting it again; a shard the store no longer holds is "missing".
STATES = ("materialized", "unrecorded", "in progress", "interrupted", "failed", "missing")
COLUMNS = ("samples", "tokens", "rejected", "errors", "bytes")
# Backfill runs execute their steps in one process: the target is loaded once per run (TargetResource) for
# both regenerated and hidden_states, as `materialize` does in process, instead of once per step process.
IN_PROCESS: dict[str, Any] = {"execution": {"config": {"in_process": {}}}}
LAUNCHED_BY_TAG = "eagle3/launched_by"
BACKFILL_DONE = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
RUN_DONE = {"SUCCESS", "FAILURE", "CANCELED"}


class OperationError(Eagle3Error):
    """The webserver refused a request, or is not on this instance; the message says what to do."""


# ---- the instance -----------------------------------------------------------------------------------------
def dagster_home(workdir: Path) -> Path:
    """`workdir/.dagster`, holding a copy of the repository's dagster.yaml (SQLite storage, the GPU pool),
    written whole under the instance lock: a command starting at the same moment never reads half of it."""
    from eagle3_dagster.instance import instance_lock

    home = workdir / ".dagster"
    home.mkdir(parents=True, exist_ok=True)
    with instance_lock(home):
        if not (home / "dagster.yaml").exists():
            atomic_write_bytes(home / "dagster.yaml", (REPO_ROOT / "dagster.yaml").read_bytes())
    return home


def instance_home(config_path: Path) -> Path:
    """$DAGSTER_HOME if set, else `.dagster` in the config file's directory."""
    if os.environ.get("DAGSTER_HOME"):
        home = Path(os.environ["DAGSTER_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        return home.resolve()
    return dagster_home(config_path.resolve().parent)


def activate(config_path: Path) -> Path:
    """Point this process at the project's instance and config (the assets' resources read EAGLE3_CONFIG)."""
    home = instance_home(config_path)
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ["EAGLE3_CONFIG"] = str(config_path.resolve())
    return home


# ---- status -----------------------------------------------------------------------------------------------
@dataclass
class ShardStatus:
    key: str
    state: str
    registered: bool  # a partition of `shards` in the instance
    samples: int | None = None  # from the hidden-state manifest; None before extraction
    tokens: int | None = None
    rejected: int | None = None  # source rows rejected at ingest into this shard
    errors: int | None = None  # samples lost at regeneration, tokenisation or extraction
    bytes: int | None = None


def classify(partition_status: str | None, interrupted: bool, held: bool) -> str:
    """A shard's state from hidden_states' partition status (Dagster's AssetPartitionStatus value or None) and
    whether the store holds the shard (eagle3_core/store/held.py)."""
    if interrupted:
        return "interrupted"
    if partition_status == "IN_PROGRESS":
        return "in progress"
    if held:
        return "materialized" if partition_status == "MATERIALIZED" else "unrecorded"
    return "failed" if partition_status == "FAILED" else "missing"


def interrupted_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Runs the instance has as started whose in-process runner (this host) is gone."""
    import dagster as dg

    from eagle3_dagster.materialize import RUNNER_TAG, runner_alive

    started = instance.get_runs(
        filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED])
    )
    return [r for r in started if RUNNER_TAG in r.tags and runner_alive(r.tags[RUNNER_TAG]) is False]


def fail_interrupted_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Mark runs whose process died as failed, as Dagster's run monitoring does for a launcher it can ask.
    Until then they count as in progress: they hold the GPU pool and automation waits on them."""
    from eagle3_dagster.materialize import RUNNER_TAG

    runs = interrupted_runs(instance)
    for run in runs:
        instance.report_run_failed(
            run, f"the process running this run ({run.tags[RUNNER_TAG]}) is gone; marked failed by eagle3"
        )
    return runs


def shard_statuses(
    cfg: Eagle3Config, instance: dg.DagsterInstance, damaged: Collection[str] = ()
) -> list[ShardStatus]:
    """Every shard of the store and every partition of `shards`: its state in the instance and the store, its
    figures from the store's manifests (no tensor file is opened). `damaged`: shards a check found damaged
    (the store does not hold them whole, whatever their files look like)."""
    from eagle3_core.store.stats import store_stats
    from eagle3_dagster.defs.data.assets import hidden_states
    from eagle3_dagster.defs.partitions import SHARDS, shards

    registered = set(instance.get_dynamic_partitions(SHARDS))
    figures = {row.key: row.values for row in store_stats(cfg.store_root).shards}
    keys = sorted(registered | set(figures) | set(store_shard_keys(cfg.store_root)))
    partition_status = instance.get_status_by_partition(hidden_states.key, keys, shards) or {}
    interrupted = {r.tags.get("dagster/partition") for r in interrupted_runs(instance)}
    layout = StoreLayout(cfg.store_root)
    rows = []
    for key in keys:
        status = partition_status.get(key)
        held = key not in damaged and held_shard(cfg.store_root, key) is not None
        state = classify(status.value if status else None, key in interrupted, held)
        row = ShardStatus(key, state, key in registered)
        if key in figures:
            for column in ("samples", "tokens", "errors", "bytes"):
                setattr(row, column, figures[key][column])
        manifest = layout.conversations_manifest(key)
        if manifest.exists():
            row.rejected = sum(ConversationManifest.read(manifest).rejected.values())
        rows.append(row)
    return rows


def totals(rows: Sequence[ShardStatus]) -> dict[str, int]:
    return {c: sum(getattr(r, c) or 0 for r in rows) for c in COLUMNS}


def state_counts(rows: Sequence[ShardStatus]) -> dict[str, int]:
    counts = Counter(r.state for r in rows)
    return {s: counts[s] for s in STATES if counts[s]}


def _cell(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


STATE_STYLE = {
    "materialized": "green",
    "unrecorded": "blue",
    "in progress": "cyan",
    "interrupted": "yellow",
    "failed": "red",
    "missing": "dim",
}


def status_table(rows: Sequence[ShardStatus], title: str, max_rows: int = 40) -> Table:
    table = Table(title=title)
    table.add_column("shard")
    table.add_column("state")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    half = max_rows // 2
    shown = list(rows) if len(rows) <= max_rows else [*rows[:half], *rows[-half:]]
    for i, row in enumerate(shown):
        if len(shown) < len(rows) and i == half:
            table.add_row(f"... {len(rows) - len(shown)} more", "", *([""] * len(COLUMNS)))
        state = row.state if row.registered else f"{row.state} (no partition)"
        table.add_row(
            row.key, f"[{STATE_STYLE[row.state]}]{state}[/]", *(_cell(getattr(row, c)) for c in COLUMNS)
        )
    summed = totals(rows)
    table.add_row("total", f"{len(rows)} shards", *(f"{summed[c]:,}" for c in COLUMNS), style="bold")
    return table


def cmd_status(args: argparse.Namespace) -> int:
    from eagle3_dagster.instance import open_instance

    config_path = Path(args.config)
    cfg = load_config(config_path)
    home = activate(config_path)
    with open_instance() as instance:
        rows = shard_statuses(cfg, instance)
    free = shutil.disk_usage(cfg.store_root).free if cfg.store_root.exists() else 0
    if args.json:
        report = {
            "dagster_home": str(home),
            "store": str(cfg.store_root),
            "shards": [asdict(r) for r in rows],
            "totals": totals(rows),
            "states": state_counts(rows),
            "disk_free": free,
        }
        print(json.dumps(report, indent=1))
        return 0
    console.print(status_table(rows, f"shards in {cfg.store_root}", 10**9 if args.all else 40))
    counts = ", ".join(f"{n} {s}" for s, n in state_counts(rows).items()) or "no shards"
    console.print(f"{counts}; disk free: {free / 2**30:.1f} GiB; instance: {home}")
    if any(r.state == "unrecorded" for r in rows):
        console.print(
            "[blue]unrecorded[/]: the store holds the shard, the instance does not know it (extracted outside "
            "Dagster); `eagle3 materialize` (or the eagle3_store sensor) records it, without extracting it again"
        )
    if any(r.state == "interrupted" for r in rows):
        console.print(
            "[yellow]interrupted[/]: the process running the shard died; "
            "`eagle3 materialize --missing` marks its run failed and runs the shard again"
        )
    return 0


# ---- the webserver ----------------------------------------------------------------------------------------
class Webserver:
    """A running `dagster dev` or webserver, through its GraphQL endpoint."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.shown = without_url_passwords(self.url)  # what is printed; the requests go to `url`

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None, timeout: float = 60.0) -> Any:
        body = {"query": query, "variables": dict(variables or {})}
        try:
            payload = http.request_json(
                "POST", f"{self.url}/graphql", body, timeout, who="the Dagster webserver"
            )
        except http.HttpError as err:
            raise OperationError(str(err)) from err
        if not isinstance(payload, dict):
            raise OperationError(
                f"{self.shown}/graphql answered {http.clip(payload)}, not a GraphQL response"
            )
        if payload.get("errors"):
            raise OperationError(f"{self.shown}/graphql answered with errors: {payload['errors']}")
        return payload["data"]

    def answers(self, timeout: float = PROBE_TIMEOUT_S) -> bool:
        try:
            return bool(self.graphql("{ version }", timeout=timeout).get("version"))
        except OperationError:
            return False

    def check_same_instance(self, instance: dg.DagsterInstance) -> None:
        """Refuse a webserver on another instance (its daemon would run the backfill against other state)."""
        info = self.graphql("{ instance { info } }")["instance"]["info"]
        if not info:  # the server hides its instance's configuration: nothing to compare
            return
        theirs, ours = yaml.safe_load(info), yaml.safe_load(instance.info_str())
        # A database's run storage names it (a container's home directory may differ from ours); SQLite's
        # names only its class, and the home directory is what tells two apart.
        part = "run_storage" if isinstance(ours.get("run_storage"), dict) else "local_artifact_storage"
        if theirs.get(part) != ours.get(part):
            raise OperationError(
                f"the webserver at {self.shown} runs on another Dagster instance ({part}: {theirs.get(part)}) "
                f"than {instance.root_directory} ({ours.get(part)}); set DAGSTER_HOME to its home, or pass "
                "--in-process"
            )


LAUNCH_BACKFILL = """
mutation Launch($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PartitionKeysNotFoundError { partitionKeys }
    ... on Error { message }
  }
}
"""

BACKFILL = """
query Backfill($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { id status runs { runId status tags { key value } } }
    ... on Error { message }
  }
}
"""


def backfill_params(keys: Sequence[str]) -> dict[str, Any]:
    """LaunchBackfillParams: the three shard assets for these partitions, one run per shard, in process."""
    return {
        "partitionNames": list(keys),
        "assetSelection": [{"path": [name]} for name in SHARD_ASSET_NAMES],
        "runConfigData": IN_PROCESS,
        "tags": [{"key": LAUNCHED_BY_TAG, "value": "eagle3 materialize"}],
        "title": "eagle3 shards",
    }


def initialize_pools(instance: dg.DagsterInstance) -> None:
    """Give the shard assets' pools ("gpu") their row and default limit before their runs are queued. Dagster's
    run queue reads the configured pools before it creates the rows of new ones, so on the pass that meets a
    pool first, that pool limits nothing: every run then queued is launched at once (Dagster 1.13)."""
    from eagle3_dagster.materialize import SHARD_ASSETS

    for pool in sorted({a.op.pool for a in SHARD_ASSETS if a.op.pool}):
        instance.event_log_storage.initialize_concurrency_limit_to_default(pool)


def launch_backfill(server: Webserver, keys: Sequence[str]) -> str:
    result = server.graphql(LAUNCH_BACKFILL, {"params": backfill_params(keys)})["launchPartitionBackfill"]
    if result["__typename"] == "LaunchBackfillSuccess":
        backfill_id: str = result["backfillId"]
        return backfill_id
    if result["__typename"] == "PartitionKeysNotFoundError":
        raise OperationError(
            f"the webserver at {server.shown} does not know the partitions {result['partitionKeys']}"
        )
    raise OperationError(f"launchPartitionBackfill: {result['__typename']}: {result.get('message')}")


def wait_for_backfill(server: Webserver, backfill_id: str, total: int) -> dict[str, Any]:
    """Poll until the backfill is done, with a bar over its shards' finished runs; returns the backfill."""
    with _progress() as progress:
        task = progress.add_task(f"backfill {backfill_id}", total=total)
        while True:
            backfill = server.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
            if backfill["__typename"] != "PartitionBackfill":
                raise OperationError(f"backfill {backfill_id}: {backfill.get('message')}")
            finished = sum(r["status"] in RUN_DONE for r in backfill["runs"])
            progress.update(
                task, completed=min(finished, total), description=f"backfill {backfill['status']}"
            )
            if backfill["status"] in BACKFILL_DONE:
                return dict(backfill)
            time.sleep(POLL_S)


# ---- materialize ------------------------------------------------------------------------------------------
def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def shards_to_run(rows: Sequence[ShardStatus], requested: Sequence[str] | None) -> list[str]:
    """The requested shards (refusing unknown or in-progress ones), else every shard not materialized and
    not in progress (missing, failed)."""
    by_key = {r.key: r for r in rows}
    if not requested:
        return [r.key for r in rows if r.state in ("missing", "failed")]
    unknown = sorted(set(requested) - set(by_key))
    if unknown:
        raise OperationError(f"unknown shard(s) {unknown}; `eagle3 status` lists them")
    busy = [k for k in requested if by_key[k].state == "in progress"]
    if busy:
        raise OperationError(f"a run for {busy} is in progress; wait for it (`eagle3 status`)")
    return list(dict.fromkeys(requested))


def pick_webserver(args: argparse.Namespace) -> Webserver | None:
    """--url (must answer), else the default URL if something answers there; none under --in-process."""
    if args.in_process:
        return None
    if args.url:
        server = Webserver(args.url)
        if not server.answers():
            raise OperationError(f"no Dagster webserver answers at {server.shown} (start one: `eagle3 ui`)")
        return server
    server = Webserver(DEFAULT_URL)
    return server if server.answers() else None


def run_in_process(keys: Sequence[str], instance: dg.DagsterInstance) -> int:
    from eagle3_dagster.materialize import materialize_shard

    failed: list[str] = []
    with _progress() as progress:
        task = progress.add_task("shards", total=len(keys))
        for key in keys:
            progress.update(task, description=f"shard {key}")
            try:
                materialize_shard(key, instance)
                console.print(f"shard {key}: materialized")
            except RuntimeError as err:
                failed.append(key)
                console.print(f"[red]shard {key}: {err}[/]")
            progress.advance(task)
    if failed:
        console.print(f"[red]{len(failed)} of {len(keys)} shard run(s) failed: {failed}[/]")
        return 1
    console.print(f"{len(keys)} shard(s) materialized in process")
    return 0


def cmd_materialize(args: argparse.Namespace) -> int:
    from eagle3_dagster.defs.data.store import record_store_shards
    from eagle3_dagster.instance import open_instance

    if not args.missing and not args.shards:
        raise OperationError("say which shards: --missing, or --shards KEY,KEY")
    config_path = Path(args.config)
    cfg = load_config(config_path)
    activate(config_path)
    requested = [k.strip() for k in args.shards.split(",") if k.strip()] if args.shards else None
    server = pick_webserver(args)
    with open_instance() as instance:
        if server is not None:
            server.check_same_instance(instance)
        for run in fail_interrupted_runs(instance):
            console.print(
                f"run {run.run_id} ({run.tags.get('dagster/partition')}): process gone, marked failed"
            )
        # What the store holds whole is recorded, not run again (the store is the truth)
        record = record_store_shards(instance, cfg, log=lambda line: console.print(line))
        if record.added:
            console.print(f"added {len(record.added)} shard partition(s)")
        if record.recorded:
            console.print(
                f"{len(record.recorded)} shard(s) the store holds recorded as materialized, not run again: "
                f"{', '.join(record.recorded)}"
            )
        keys = shards_to_run(shard_statuses(cfg, instance, damaged=record.refused), requested)
        if not keys:
            console.print(
                "nothing to materialize: every shard is materialized or in progress (`eagle3 status`)"
            )
            return 0
        console.print(f"{len(keys)} shard(s) to materialize: {', '.join(keys)}")
        if server is None:
            return run_in_process(keys, instance)
        initialize_pools(instance)
    backfill_id = launch_backfill(server, keys)
    console.print(
        f"backfill {backfill_id} launched through {server.shown}: {server.shown}/runs/b/{backfill_id}"
    )
    if not args.wait:
        return 0
    backfill = wait_for_backfill(server, backfill_id, len(keys))
    failed = [r["runId"] for r in backfill["runs"] if r["status"] != "SUCCESS"]
    console.print(f"backfill {backfill_id}: {backfill['status']}, {len(backfill['runs'])} run(s)")
    if failed or backfill["status"] not in ("COMPLETED", "COMPLETED_SUCCESS"):
        console.print(f"[red]not every run succeeded: {failed}[/]")
        return 1
    return 0


# ---- ui ---------------------------------------------------------------------------------------------------
def ui_command(config_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """`dagster dev` on 127.0.0.1 over the repository's workspace, with the project's instance and config."""
    home = instance_home(config_path)
    dagster = Path(sys.executable).parent / "dagster"
    argv = [
        str(dagster) if dagster.exists() else "dagster",
        "dev",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-w",
        str(WORKSPACE),
    ]
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_CONFIG": str(config_path.resolve())}
    return argv, env


def cmd_ui(args: argparse.Namespace) -> int:
    from eagle3_dagster.instance import open_instance

    argv, env = ui_command(Path(args.config), args.port)
    activate(Path(args.config))
    # The instance is created here, under the instance lock, before `dagster dev` opens it in its own
    # processes (which take no lock): they find its storage whole. The pool before the queue first meets it.
    with open_instance() as instance:
        initialize_pools(instance)
    console.print(
        f"Dagster UI: http://127.0.0.1:{args.port} (DAGSTER_HOME={env['DAGSTER_HOME']}, "
        f"EAGLE3_CONFIG={env['EAGLE3_CONFIG']})"
    )
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)  # replaces this process: Ctrl-C and signals reach dagster dev itself


def add_ops_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="Per shard: its state in the Dagster instance and its figures from the store; totals, disk free.",
    )
    p.add_argument("--json", action="store_true", help="One JSON document, for machines.")
    p.add_argument("--all", action="store_true", help="One row per shard even when there are many.")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser(
        "materialize",
        help="Run shards through conversations -> regenerated -> hidden_states: a backfill through the "
        "webserver when one answers, else in this process.",
    )
    p.add_argument("--missing", action="store_true", help="Every shard not materialized nor in progress.")
    p.add_argument("--shards", help="These shards instead, comma-separated (run again if materialized).")
    p.add_argument("--url", help=f"The webserver (default: {DEFAULT_URL} if it answers within 2 s).")
    p.add_argument("--in-process", action="store_true", help="Run here even if a webserver answers.")
    p.add_argument("--wait", action="store_true", help="After launching a backfill, wait for its runs.")
    p.set_defaults(fn=cmd_materialize)
    p = sub.add_parser("ui", help="`dagster dev` on 127.0.0.1 with this project's instance and config.")
    p.add_argument("--port", "-p", type=int, default=3000)
    p.set_defaults(fn=cmd_ui)
