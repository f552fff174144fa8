"""The checked-in two-node recipes (docker/slurm, docker/k8s), where no scheduler runs: the Slurm script is
valid bash whose directives and `eagle3 train` line agree (the line parsed by eagle3's own parser); the
Kubernetes manifest parses, its Indexed Job has a pod a node, and the rendezvous it names is pod 0's stable
name under the headless Service. What the nodes then do is tests/integration/test_train.py's (two agents as
two nodes on 127.0.0.1)."""

from __future__ import annotations

import re
import shlex
import subprocess

import yaml

from eagle3_cli.steps import build_parser
from tests.conftest import REPO

SBATCH = REPO / "docker" / "slurm" / "train-two-nodes.sbatch"
MANIFEST = REPO / "docker" / "k8s" / "train-two-nodes.yaml"


def _train_args(argv: list[str]) -> dict[str, object]:
    parser, _ = build_parser()
    return vars(parser.parse_args(argv))


def test_the_slurm_script_is_bash_and_its_train_line_matches_its_directives() -> None:
    syntax = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "1"  # one `eagle3 train` a node
    command = " ".join(line.rstrip("\\").strip() for line in text.split("srun", 1)[1].splitlines()).strip()
    # what Slurm sets on each node of this job
    values = {"$EAGLE3_CONFIG": "/shared/eagle3.yaml", "$SLURM_JOB_NUM_NODES": directives["nodes"],
              "${SLURM_GPUS_ON_NODE:-8}": directives["gpus-per-node"], "$first_node": "gpu-001"}  # fmt: skip
    for name, value in values.items():
        command = command.replace(name, value)
    words = shlex.split(command)
    args = _train_args(words[words.index("eagle3") + 1 :])
    assert args["nodes"] == 2 and args["nproc"] == 8 and args["rendezvous"] == "gpu-001:29400"
    assert args["config"] == "/shared/eagle3.yaml"


def test_the_kubernetes_job_runs_a_pod_a_node_and_meets_at_pod_0() -> None:
    service, job = yaml.safe_load_all(MANIFEST.read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"  # JOB_COMPLETION_INDEX: the node rank
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    args = _train_args([*container["command"][1:], *container["args"]])
    assert spec["completions"] == spec["parallelism"] == args["nodes"] == 2
    host, port = str(args["rendezvous"]).split(":")
    # an Indexed Job's pod i is <job>-<i>; with the Service as its subdomain, pod 0 resolves by that name
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert int(port) == service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == args["nproc"] == 8
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["store"] == "/store" and args["config"].startswith(mounts["config"])
