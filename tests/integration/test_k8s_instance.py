"""The Kubernetes deployment's instance, docker/k8s/dagster.yaml, with dagster-k8s: no cluster runs here, so the
file is loaded against a real PostgreSQL server (tests/integration/conftest.py) with one change, its run
launcher reaching tests/k8s_api_stub.py through a kubeconfig instead of a pod's service account, and the Jobs
its K8sRunLauncher creates for runs of eagle3's own code location are recorded by the stub (nothing runs them).

The code location is served as a deployment serves it, by a gRPC server with DAGSTER_CURRENT_IMAGE set (which
is where a run's image comes from); a run is created from it as `dagster job launch` creates one, submitted
(the QueuedRunCoordinator queues it) and then launched as the daemon launches a dequeued run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from dagster._config import process_config
from dagster._core.definitions.selector import JobSubsetSelector
from dagster._core.workspace.context import BaseWorkspaceRequestContext, WorkspaceProcessContext
from dagster._core.workspace.load_target import ModuleTarget
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import deserialize_value

from tests.conftest import REPO, write_config
from tests.k8s_api_stub import KubernetesApiStub
from tests.postgres_server import PostgresServer, assert_postgres_queued_and_pooled

K8S_DAGSTER_YAML = REPO / "docker" / "k8s" / "dagster.yaml"
IMAGE = "registry.example/eagle3:1"
LOCATION = "eagle3"
SHARD = "fx-00000"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_TAG = {
    "container_config": {"resources": {"limits": {"nvidia.com/gpu": "8"}}},
    "pod_spec_config": {"tolerations": [GPU_TOLERATION]},
}


@pytest.fixture
def stub() -> Iterator[KubernetesApiStub]:
    with KubernetesApiStub() as stub:
        yield stub


@pytest.fixture
def k8s_home(
    tmp_path: Path, postgres_database: str, stub: KubernetesApiStub, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A DAGSTER_HOME (on a database of its own) whose dagster.yaml is docker/k8s/dagster.yaml but for the
    launcher's way to the API: the stub's kubeconfig instead of the in-cluster config. Asserted the only change."""
    original = K8S_DAGSTER_YAML.read_text()
    kubeconfig = stub.kubeconfig(tmp_path / "kubeconfig")
    in_cluster = "    load_incluster_config: true\n"
    assert original.count(in_cluster) == 1
    changed = original.replace(
        in_cluster, f"    load_incluster_config: false\n    kubeconfig_file: {kubeconfig}\n"
    )
    expected = yaml.safe_load(original)
    expected["run_launcher"]["config"] |= {"load_incluster_config": False, "kubeconfig_file": str(kubeconfig)}
    assert yaml.safe_load(changed) == expected
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(changed)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def test_the_launcher_config_as_checked_in_is_valid_for_dagster_k8s() -> None:
    from dagster_k8s import K8sRunLauncher

    launcher = yaml.safe_load(K8S_DAGSTER_YAML.read_text())["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    processed = process_config(K8sRunLauncher.config_type(), launcher["config"])
    assert processed.success, processed.errors
    assert processed.value is not None and processed.value["load_incluster_config"] is True


def test_the_k8s_instance_is_postgres_queued_pooled_monitored_and_k8s_launched(k8s_home: Path) -> None:
    from dagster_k8s import K8sRunLauncher

    with dg.DagsterInstance.from_config(str(k8s_home)) as instance:
        assert_postgres_queued_and_pooled(instance)
        launcher = instance.run_launcher
        assert isinstance(launcher, K8sRunLauncher)
        assert (launcher.job_namespace, launcher.service_account_name) == ("eagle3", "dagster")
        assert instance.run_monitoring_settings["start_timeout_seconds"] == 600  # a GPU node to provision


def _create_run(
    instance: dg.DagsterInstance, workspace: BaseWorkspaceRequestContext, asset: str, tags: Mapping[str, str]
) -> dg.DagsterRun:
    """A run of the code location's implicit asset job materializing `asset` for SHARD, created as `dagster job
    launch` creates one: the job, its execution plan and snapshot, its origins, from the code location."""
    location = workspace.get_code_location(LOCATION)
    [repository] = location.get_repositories().values()
    selection = {dg.AssetKey(asset)}
    job = location.get_job(
        JobSubsetSelector(
            location_name=LOCATION,
            repository_name=repository.name,
            job_name="__ASSET_JOB",
            op_selection=None,
            asset_selection=selection,
        )
    )
    plan = location.get_execution_plan(
        job, {}, step_keys_to_execute=None, known_state=None, instance=instance
    )
    return instance.create_run(
        job_name=job.name,
        run_id=None,
        run_config={},
        status=None,
        tags={**job.tags, "dagster/partition": SHARD, **tags},
        root_run_id=None,
        parent_run_id=None,
        step_keys_to_execute=plan.execution_plan_snapshot.step_keys_to_execute,
        execution_plan_snapshot=plan.execution_plan_snapshot,
        job_snapshot=job.job_snapshot,
        parent_job_snapshot=job.parent_job_snapshot,
        asset_selection=selection,
        asset_check_selection=None,
        resolved_op_selection=job.resolved_op_selection,
        op_selection=None,
        remote_job_origin=job.get_remote_origin(),
        job_code_origin=job.get_python_origin(),
        asset_graph=repository.asset_graph,
    )


def _assert_the_files_run_pod(job: dict[str, Any], run: dg.DagsterRun) -> dict[str, Any]:
    """What docker/k8s/dagster.yaml says of every run's Job, and that it executes `run`. Its container."""
    assert job["metadata"]["namespace"] == "eagle3"
    assert job["metadata"]["labels"]["dagster/run-id"] == run.run_id
    assert job["metadata"]["labels"]["dagster/code-location"] == LOCATION
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "dagster"
    assert pod["restartPolicy"] == "Never"
    [container] = pod["containers"]
    assert container["image"] == IMAGE

    volumes = {v["name"]: {k: v for k, v in v.items() if k != "name"} for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {path: volumes[m["name"]] for path, m in mounts.items()} == {
        "/store": {"persistentVolumeClaim": {"claimName": "eagle3-store"}},
        "/models": {"persistentVolumeClaim": {"claimName": "eagle3-models"}},
        "/config": {"configMap": {"name": "eagle3-config"}},
        "/dev/shm": {"emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
    }
    assert len(volumes) == 4  # no other volume (the instance comes in the args, not from a mount)
    assert {path for path, m in mounts.items() if m.get("readOnly")} == {"/models", "/config"}

    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EAGLE3_CONFIG"] == "/config/eagle3.yaml"
    assert env["DAGSTER_HOME"] == "/opt/dagster/dagster_home"
    assert container["envFrom"] == [
        {"configMapRef": {"name": "dagster-postgres-env"}},
        {"secretRef": {"name": "dagster-postgres-password"}},
    ]

    # the container runs this run: `dagster api execute_run` with the run, its code and the instance
    assert container["args"][:3] == ["dagster", "api", "execute_run"]
    args = deserialize_value(container["args"][3], ExecuteRunArgs)
    assert args.run_id == run.run_id
    assert args.job_origin == run.job_code_origin
    repository = args.job_origin.repository_origin
    assert repository.container_image == IMAGE
    assert getattr(repository.code_pointer, "module", None) == "eagle3_dagster.definitions"
    assert args.instance_ref is not None
    run_storage = args.instance_ref.run_storage_data
    assert run_storage is not None
    assert (run_storage.module_name, run_storage.class_name) == ("dagster_postgres", "PostgresRunStorage")
    # credentials by name, for the pod's own environment (the config map and secret above) to resolve
    assert yaml.safe_load(run_storage.config_yaml)["postgres_db"]["password"] == {
        "env": "DAGSTER_POSTGRES_PASSWORD"
    }
    return container


def test_runs_of_eagle3_launch_as_the_jobs_of_the_file(
    k8s_home: Path,
    tmp_path: Path,
    postgres: PostgresServer,
    stub: KubernetesApiStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = write_config(tmp_path / "project", "store: store\ntarget: {path: toy}\n")
    monkeypatch.setenv("EAGLE3_CONFIG", str(config))
    monkeypatch.setenv("DAGSTER_CURRENT_IMAGE", IMAGE)  # as the code location's Deployment sets it
    code_location = ModuleTarget(
        module_name="eagle3_dagster.definitions",
        attribute=None,
        working_directory=str(REPO),
        location_name=LOCATION,
    )
    with (
        dg.DagsterInstance.from_config(str(k8s_home)) as instance,
        WorkspaceProcessContext(instance, code_location) as process_context,
    ):
        workspace = process_context.create_request_context()
        instance.add_dynamic_partitions("shards", [SHARD])
        gpu_run = _create_run(
            instance, workspace, "hidden_states", {"dagster-k8s/config": json.dumps(GPU_TAG)}
        )
        cpu_run = _create_run(instance, workspace, "conversations", {})
        for run in (gpu_run, cpu_run):
            assert run.job_code_origin is not None
            assert instance.submit_run(run.run_id, workspace).status == dg.DagsterRunStatus.QUEUED
        assert stub.jobs == []  # queued: the daemon launches it, as below
        for run in (gpu_run, cpu_run):
            instance.launch_run(run.run_id, workspace)
        launched = [instance.get_run_by_id(run.run_id) for run in (gpu_run, cpu_run)]

    assert [j["metadata"]["name"] for j in stub.jobs] == [
        f"dagster-run-{gpu_run.run_id}",
        f"dagster-run-{cpu_run.run_id}",
    ]
    for launched_run in launched:
        assert launched_run is not None and launched_run.status == dg.DagsterRunStatus.STARTING
        assert launched_run.tags["dagster/image"] == IMAGE  # the launcher records the Job's image
    gpu_job, cpu_job = stub.jobs
    gpu = _assert_the_files_run_pod(gpu_job, gpu_run)
    assert gpu["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert gpu_job["spec"]["template"]["spec"]["tolerations"] == [GPU_TOLERATION]
    cpu = _assert_the_files_run_pod(cpu_job, cpu_run)
    assert "nvidia.com/gpu" not in json.dumps(cpu.get("resources") or {})
    assert not cpu_job["spec"]["template"]["spec"].get("tolerations")  # kept off the GPU nodes
    # the database password reaches no Job: only the names of the variables holding it
    assert postgres.password not in json.dumps(stub.jobs)
