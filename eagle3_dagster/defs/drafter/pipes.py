"""Training as a Dagster Pipes process: a subprocess of the run, or a Kubernetes pod through dagster-k8s's
PipesK8sClient. Either way the trainer's log lines and result come back to the asset page."""

from pathlib import Path

import dagster as dg

from eagle3_core.config import Eagle3Config
from eagle3_core.errors import Eagle3Error
from eagle3_core.steps.drafter import pipes_command
from eagle3_core.steps.training_pod import training_pod


def train_through_pipes(
    context: dg.AssetExecutionContext, cfg: Eagle3Config, config_path: Path
) -> dg.MaterializeResult:
    if cfg.orchestration.training != "k8s":
        invocation = dg.PipesSubprocessClient().run(command=pipes_command(config_path), context=context)
        return invocation.get_materialize_result()
    try:
        from dagster_k8s import PipesK8sClient
    except ImportError:
        raise Eagle3Error(
            "orchestration.training: k8s needs dagster-k8s (pip install 'eagle3[k8s]')"
        ) from None
    pod = training_pod(cfg, config_path)
    client = PipesK8sClient(kubeconfig_file=str(pod.kubeconfig) if pod.kubeconfig else None)
    invocation = client.run(
        context=context, image=pod.image, command=pod.command, namespace=pod.namespace,
        base_pod_spec=pod.spec, pod_wait_timeout=pod.timeout_seconds,
    )  # fmt: skip
    return invocation.get_materialize_result()
