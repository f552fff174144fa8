"""The pod orchestration.training: k8s trains in (eagle3_core/steps/training_pod.py): what PipesK8sClient is
given. The pod itself runs against tests/k8s_api_stub.py in tests/integration/test_train.py."""

from pathlib import Path

import pytest

from eagle3_core.config import load_config
from eagle3_core.errors import Eagle3Error
from eagle3_core.steps.training_pod import CONTAINER, TrainingPod, training_pod
from tests.conftest import write_config

POD = (
    "orchestration: {training: k8s, k8s: {image: 'registry.example/eagle3:1', namespace: ml, "
    "volumes: {%s}, pod_spec: {nodeSelector: {pool: h200}, volumes: [{name: extra, emptyDir: {}}]}%s}}\n"
)


def _pod(tmp_path: Path, volumes: str, train: str = "", more: str = "") -> TrainingPod:
    config = write_config(tmp_path / "project", f"store: {tmp_path}/data/store\ncache: {tmp_path}/data/cache\n"
                          f"target: {{path: {tmp_path}/models/llama}}\n{train}" + POD % (volumes, more))  # fmt: skip
    return training_pod(load_config(config), config)


def test_the_pod_runs_eagle3_train_on_the_runs_paths_with_its_gpus_and_shared_memory(tmp_path: Path) -> None:
    volumes = f"{tmp_path}/project: config, {tmp_path}/data: store, {tmp_path}/models: models"
    pod = _pod(tmp_path, volumes, train="train: {processes: 4}\n", more=", timeout_hours: 2")
    config = tmp_path / "project" / "eagle3.yaml"
    assert pod.command == ["python", "-m", "eagle3_cli.steps", "--config", str(config), "train", "--pipes"]
    assert (pod.image, pod.namespace, pod.kubeconfig, pod.timeout_seconds) == (
        "registry.example/eagle3:1", "ml", None, 7200
    )  # fmt: skip
    [container] = pod.spec["containers"]
    assert container["name"] == CONTAINER and container["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.spec["volumes"]
              if "persistentVolumeClaim" in v}  # fmt: skip
    mounted = {m["mountPath"]: claims.get(m["name"], m["name"]) for m in container["volumeMounts"]}
    assert mounted == {
        f"{tmp_path}/project": "config", f"{tmp_path}/data": "store", f"{tmp_path}/models": "models",
        "/dev/shm": "shm",
    }  # fmt: skip
    [shm] = [v for v in pod.spec["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert (
        pod.spec["nodeSelector"] == {"pool": "h200"}
        and {"name": "extra", "emptyDir": {}} in pod.spec["volumes"]
    )


def test_one_process_on_cpu_asks_for_no_gpu_and_no_shared_memory(tmp_path: Path) -> None:
    pod = _pod(tmp_path, f"{tmp_path}: everything", train="train: {device: cpu}\n")
    [container] = pod.spec["containers"]
    assert "resources" not in container and [m["mountPath"] for m in container["volumeMounts"]] == [
        str(tmp_path)
    ]
    assert pod.timeout_seconds == 0


@pytest.mark.parametrize(
    ("volumes", "unseen"),
    [
        ("{p}/project: config, {p}/models: models", "store ({p}/data/store), cache ({p}/data/cache)"),
        ("{p}/project: config, {p}/data: store", "target.path ({p}/models/llama)"),
        ("{p}/data: store, {p}/models: models", "the config file ({p}/project/eagle3.yaml)"),
    ],
)
def test_a_path_the_pod_would_not_see_is_named(tmp_path: Path, volumes: str, unseen: str) -> None:
    with pytest.raises(Eagle3Error) as err:
        _pod(tmp_path, volumes.format(p=tmp_path))
    assert str(err.value).startswith(
        f"orchestration.k8s.volumes: the pod would not see {unseen.format(p=tmp_path)};"
    )


def test_several_nodes_are_sent_to_the_indexed_job_recipe(tmp_path: Path) -> None:
    with pytest.raises(Eagle3Error, match=r"train.nodes is 2: .*docker/k8s/train-two-nodes.yaml"):
        _pod(tmp_path, f"{tmp_path}: everything", train="train: {nodes: 2, rendezvous: 'h:29500'}\n")
