"""A snapshot of every asset and check spec of the code location, and of what each of its jobs selects: an
accidental change to the graph (a key, a dependency, a partitioning, a pool, an automation condition, a check's
blocking flag, a job's assets, checks or partitions) fails here.

After an intended change: EAGLE3_UPDATE_SNAPSHOTS=1 pytest tests/unit/test_asset_specs.py, and commit the
snapshot with the change.
"""

import json
import os
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).resolve().parent.parent / "snapshots" / "asset_specs.json"


def current_specs() -> dict[str, Any]:
    from eagle3_dagster.definitions import defs

    graph = defs.resolve_asset_graph()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        partitions = node.partitions_def
        assets[key.to_user_string()] = {
            "deps": sorted(p.to_user_string() for p in node.parent_keys),
            "partitions": getattr(partitions, "name", None)
            or (None if partitions is None else str(partitions)),
            "pools": sorted(node.pools or []),
            "automation_condition": None
            if node.automation_condition is None
            else str(node.automation_condition),
            "group": node.group_name,
            "kinds": sorted(node.kinds),
        }
    checks = {}
    for check_key in sorted(graph.asset_check_keys, key=lambda k: (k.asset_key.to_user_string(), k.name)):
        spec = graph.get_check_spec(check_key)
        checks[f"{check_key.asset_key.to_user_string()}:{check_key.name}"] = {"blocking": spec.blocking}
    jobs = {}
    for job in defs.get_repository_def().get_all_jobs():
        if job.name.startswith("__"):  # Dagster's implicit job of every asset
            continue
        layer = job.asset_layer
        jobs[job.name] = {
            "assets": sorted(k.to_user_string() for k in layer.selected_asset_keys),
            "checks": sorted(
                f"{c.asset_key.to_user_string()}:{c.name}" for c in layer.asset_graph.asset_check_keys
            ),
            "partitions": getattr(job.partitions_def, "name", None),
        }
    return {"assets": assets, "checks": checks, "jobs": jobs}


def test_the_asset_graph_matches_its_snapshot() -> None:
    specs = current_specs()
    if os.environ.get("EAGLE3_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(specs, indent=1, sort_keys=True) + "\n")
    assert SNAPSHOT.exists(), f"no snapshot yet: run with EAGLE3_UPDATE_SNAPSHOTS=1 to write {SNAPSHOT}"
    assert specs == json.loads(SNAPSHOT.read_text())
