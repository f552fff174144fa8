"""The Kubernetes pod `drafter_checkpoint` trains in under orchestration.training: k8s.

Dagster's PipesK8sClient (dagster-k8s) creates the pod, injects the Pipes context into its environment and
reads the trainer's messages back from its logs; this module only says what the pod is: eagle3's image
running `eagle3 train --pipes` on the config the run reads, the claims that make the run's paths visible at
the same paths, the GPUs and a memory-backed /dev/shm. Plain dictionaries in Kubernetes' own spelling, so
the library needs neither dagster nor the kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_core.config import Eagle3Config, KubernetesTrainingConfig
from eagle3_core.errors import Eagle3Error
from eagle3_core.targets.gguf import is_gguf_target

CONTAINER = "eagle3-train"


@dataclass(frozen=True)
class TrainingPod:
    image: str
    command: list[str]
    namespace: str | None
    kubeconfig: Path | None
    spec: dict[str, Any]  # a PodSpec, Kubernetes' field names; PipesK8sClient adds the Pipes environment
    timeout_seconds: float  # 0: no limit


def training_pod(cfg: Eagle3Config, config_path: Path) -> TrainingPod:
    """The pod for this config; Eagle3Error naming the field when it cannot train the run as configured."""
    k8s = cfg.orchestration.k8s
    assert k8s is not None, "the config refuses orchestration.training: k8s without orchestration.k8s"
    if cfg.train.nodes > 1:
        raise Eagle3Error(
            "orchestration.training: k8s starts one pod, and train.nodes is "
            f"{cfg.train.nodes}: run several nodes as the Indexed Job of docker/k8s/train-two-nodes.yaml"
        )
    _check_mounted(k8s, _paths_read(cfg, config_path))
    volumes = [
        {"name": f"claim-{i}", "persistentVolumeClaim": {"claimName": claim}}
        for i, claim in enumerate(k8s.volumes.values())
    ]
    mounts = [{"name": f"claim-{i}", "mountPath": path} for i, path in enumerate(k8s.volumes)]
    if cfg.train.processes > 1:  # torchrun's ranks and NCCL share memory through /dev/shm
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {"name": CONTAINER, "volumeMounts": mounts}
    gpus = k8s.gpus if k8s.gpus is not None else (0 if cfg.train.device == "cpu" else cfg.train.processes)
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    spec = {
        **k8s.pod_spec,
        "containers": [container],
        "volumes": [*k8s.pod_spec.get("volumes", []), *volumes],
    }
    return TrainingPod(
        image=k8s.image,
        # the image's python: the run's own interpreter may live elsewhere (a laptop dispatching to a cluster)
        command=["python", "-m", "eagle3_cli.steps", "--config", str(config_path), "train", "--pipes"],
        namespace=k8s.namespace,
        kubeconfig=cfg.resolve(k8s.kubeconfig) if k8s.kubeconfig else None,
        spec=spec,
        timeout_seconds=k8s.timeout_hours * 3600 if k8s.timeout_hours else 0,
    )


def _paths_read(cfg: Eagle3Config, config_path: Path) -> dict[str, Path]:
    """What training reads and writes, by the config field that names it."""
    paths = {"the config file": config_path.resolve(), "store": cfg.store_root, "cache": cfg.cache_root}
    if cfg.target.path != "toy" and not is_gguf_target(cfg.target.path):  # those are built into the cache
        paths["target.path"] = cfg.resolve(cfg.target.path)
    return paths


def _check_mounted(k8s: KubernetesTrainingConfig, paths: dict[str, Path]) -> None:
    mounts = [Path(m) for m in k8s.volumes]
    unseen = [
        f"{field} ({path})"
        for field, path in paths.items()
        if not any(path.is_relative_to(m) for m in mounts)
    ]
    if unseen:
        raise Eagle3Error(
            f"orchestration.k8s.volumes: the pod would not see {', '.join(unseen)}; mount a claim holding "
            f"each at the same path (mounted now: {sorted(k8s.volumes) or 'nothing'})"
        )
