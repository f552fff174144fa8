"""dagster-k8s's PipesK8sClient runs a pod end to end against tests/k8s_api_stub.py, in a real materialization:
the pod's Pipes messages come back through its logs, a non-zero exit fails the step, and either way the
pod is deleted."""

import sys
from pathlib import Path

import dagster as dg
from dagster_k8s import PipesK8sClient

from tests.k8s_api_stub import KubernetesApiStub

REPORTS = """
from dagster_pipes import open_dagster_pipes

with open_dagster_pipes() as pipes:
    pipes.log.info("hello from the pod")
    pipes.report_asset_materialization(metadata={"answer": 42})
"""

FAILS = "import sys; print('the pod gives up', flush=True); sys.exit(3)"


def _materialize(stub: KubernetesApiStub, tmp_path: Path, script: str) -> dg.ExecuteInProcessResult:
    kubeconfig = str(stub.kubeconfig(tmp_path / "kubeconfig"))

    @dg.asset
    def pod(context: dg.AssetExecutionContext) -> dg.MaterializeResult[None]:
        client = PipesK8sClient(kubeconfig_file=kubeconfig, poll_interval=0.2)
        command = [sys.executable, "-c", script]
        invocation = client.run(context=context, image="unused", command=command, namespace="ns")
        return invocation.get_materialize_result()

    return dg.materialize([pod], raise_on_error=False)


def test_a_pod_reports_its_materialization_through_pipes_and_is_deleted(tmp_path: Path) -> None:
    with KubernetesApiStub() as stub:
        result = _materialize(stub, tmp_path, REPORTS)

    assert result.success
    [materialization] = result.asset_materializations_for_node("pod")
    assert materialization.metadata["answer"] == dg.IntMetadataValue(42)
    [created] = stub.created
    [container] = created["spec"]["containers"]
    assert "DAGSTER_PIPES_CONTEXT" in {e["name"] for e in container["env"]}
    assert created["spec"]["restartPolicy"] == "Never"
    assert stub.deleted == [created["metadata"]["name"]]


def test_a_pod_exiting_non_zero_fails_the_step_with_its_last_lines_and_is_deleted(tmp_path: Path) -> None:
    with KubernetesApiStub() as stub:
        result = _materialize(stub, tmp_path, FAILS)

    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error
    assert error is not None
    assert "DagsterK8sError" in error.to_string()
    assert "the pod gives up" in error.to_string()  # wait_for_pod's tail of the log
    [created] = stub.created
    assert stub.deleted == [created["metadata"]["name"]]
