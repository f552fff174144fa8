"""`launch_training` decides, for the CLI and the Dagster asset alike, where drafter_checkpoint runs: in this
process, under a torchrun it starts, or here as one rank of a torchrun someone else started."""

from pathlib import Path

import pytest

from eagle3_core.steps import drafter
from eagle3_core.steps.common import StepResult
from tests.conftest import write_config


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What launch_training ran, in order: vocab, here (in this process), or torchrun:N."""
    ran: list[str] = []

    def result(what: str) -> StepResult:
        ran.append(what)
        return StepResult("drafter_checkpoint", Path(what), {})

    monkeypatch.setattr(drafter, "vocab_step", lambda cfg, log: result("vocab"))
    monkeypatch.setattr(drafter, "drafter_checkpoint_step", lambda cfg, log: result("here"))
    monkeypatch.setattr(drafter, "_torchrun_training", lambda path, cfg, n, log: result(f"torchrun:{n}"))
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return ran


def _config(tmp_path: Path, processes: int) -> Path:
    return write_config(tmp_path, f"store: store\ntrain:\n  processes: {processes}\n")


def test_one_process_trains_here_after_the_vocab(tmp_path: Path, calls: list[str]) -> None:
    drafter.launch_training(_config(tmp_path, 1), with_vocab=True)
    assert calls == ["vocab", "here"]


def test_more_processes_start_torchrun_once_the_vocab_is_built(tmp_path: Path, calls: list[str]) -> None:
    drafter.launch_training(_config(tmp_path, 2), with_vocab=True)
    assert calls == ["vocab", "torchrun:2"]
    calls.clear()
    drafter.launch_training(_config(tmp_path, 2), processes=1)  # --nproc 1 overrides train.processes
    assert calls == ["here"]


def test_a_rank_of_another_launch_trains_here_and_leaves_the_vocab(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    drafter.launch_training(_config(tmp_path, 2), processes=2, with_vocab=True)
    assert calls == ["here"]
    assert drafter.torchrun_rank() == 1 and not drafter.lead_process()
    monkeypatch.setenv("RANK", "0")
    assert drafter.lead_process()
    monkeypatch.delenv("WORLD_SIZE")
    assert drafter.torchrun_rank() is None and drafter.lead_process()


def _nodes(tmp_path: Path, rendezvous: str = "10.0.0.1:29400") -> Path:
    return write_config(
        tmp_path, f"store: store\ntrain:\n  processes: 4\n  nodes: 2\n  rendezvous: '{rendezvous}'\n"
    )


def test_only_node_0_builds_the_vocab_and_every_node_starts_torchrun(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in drafter.NODE_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NODEID", "0")
    drafter.launch_training(_nodes(tmp_path), with_vocab=True)
    monkeypatch.setenv("SLURM_NODEID", "1")
    drafter.launch_training(_nodes(tmp_path), with_vocab=True)
    monkeypatch.delenv("SLURM_NODEID")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")  # a Kubernetes indexed job's pod 0
    drafter.launch_training(_nodes(tmp_path), with_vocab=True)
    assert calls == ["vocab", "torchrun:4", "torchrun:4", "vocab", "torchrun:4"]


def test_the_torchrun_command_is_standalone_on_one_node_and_c10d_across_nodes(tmp_path: Path) -> None:
    from eagle3_core.config import load_config

    one = drafter.torchrun_command(_config(tmp_path / "a", 2), load_config(_config(tmp_path / "a", 2)), 2)
    assert "--standalone" in one and "--nproc-per-node=2" in one and not any("rdzv" in a for a in one)
    config = _nodes(tmp_path / "b")
    two = drafter.torchrun_command(config, load_config(config), 4)
    assert "--nnodes=2" in two and "--rdzv-backend=c10d" in two and "--rdzv-endpoint=10.0.0.1:29400" in two
    assert "--standalone" not in two and "--nproc-per-node=4" in two
    [rdzv_id] = [a for a in two if a.startswith("--rdzv-id=")]
    again = _nodes(tmp_path / "b")  # every node of the run names the same rendezvous
    assert rdzv_id in drafter.torchrun_command(again, load_config(again), 4)


def test_a_job_script_s_nodes_and_rendezvous_stand_in_for_the_config_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_core.config import TrainConfig
    from eagle3_core.errors import Eagle3Error

    seen: list[TrainConfig] = []

    def torchrun(path: Path, cfg: object, n: int, log: object) -> StepResult:
        seen.append(cfg.train)  # type: ignore[attr-defined]
        return StepResult("drafter_checkpoint", path, {})

    monkeypatch.setattr(drafter, "_torchrun_training", torchrun)
    monkeypatch.setattr(drafter, "vocab_step", lambda cfg, log: None)
    monkeypatch.setenv("SLURM_NODEID", "1")
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    drafter.launch_training(_config(tmp_path, 8), nodes=2, rendezvous="gpu-001:29400")
    assert (seen[0].nodes, seen[0].rendezvous, seen[0].processes) == (2, "gpu-001:29400", 8)
    with pytest.raises(Eagle3Error, match=r"^--nodes: Input should be greater than 0$"):
        drafter.launch_training(_config(tmp_path, 8), nodes=0)


def test_a_rendezvous_that_is_not_host_and_port_is_refused_in_one_line(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagle3_cli.steps import main
    from eagle3_core.errors import Eagle3Error

    monkeypatch.setenv("SLURM_NODEID", "1")
    config = _config(tmp_path, 8)
    for bad in ("gpu-001", "gpu-001:", ":29400", "gpu-001:99999", "gpu-001:0", "gpu-001:http", "a b:29400"):
        with pytest.raises(Eagle3Error, match=r"^--rendezvous: host:port .* 1 to 65535"):
            drafter.launch_training(config, nodes=2, rendezvous=bad)
    assert calls == []
    for good in ("gpu-001:29400", "10.0.0.1:1", "[fe80::1]:65535", "eagle3-train-0.eagle3-train:29400"):
        drafter.launch_training(config, nodes=2, rendezvous=good)
    assert calls == ["torchrun:8"] * 4
    argv = ["--config", str(config), "train", "--no-vocab", "--nodes", "2", "--rendezvous", "gpu-001:99999"]
    assert main(argv) == 2
    [line] = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("error: --rendezvous: host:port") and "Traceback" not in line


def test_a_node_rank_beyond_the_run_s_nodes_is_refused_naming_its_variable(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_core.errors import Eagle3Error

    for name in drafter.NODE_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, rank in (("SLURM_NODEID", "5"), ("SLURM_NODEID", "2"), ("JOB_COMPLETION_INDEX", "2")):
        monkeypatch.setenv(name, rank)
        for with_vocab in (True, False):  # the rank is checked whether or not this node builds the vocab
            with pytest.raises(Eagle3Error, match=rf"^{name}={rank}: .* below train.nodes \(2\)"):
                drafter.launch_training(_nodes(tmp_path), with_vocab=with_vocab)
        monkeypatch.delenv(name)
    assert calls == []
    monkeypatch.setenv("EAGLE3_NODE_RANK", "2")
    drafter.launch_training(_nodes(tmp_path), with_vocab=True, nodes=3)  # --nodes 3: ranks 0, 1 and 2
    assert calls == ["torchrun:4"]
    with pytest.raises(Eagle3Error, match=r"^EAGLE3_NODE_RANK=2: .* below --nodes \(2\)"):
        drafter.launch_training(_config(tmp_path, 4), nodes=2, rendezvous="gpu-001:29400")


def test_a_non_positive_nproc_is_refused_in_one_line(
    tmp_path: Path, calls: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from eagle3_cli.steps import main
    from eagle3_core.errors import Eagle3Error

    config = _config(tmp_path, 2)
    for bad in (0, -1):  # 0 fell back to train.processes; -1 trained in one process
        with pytest.raises(Eagle3Error, match=rf"^--nproc: Input should be greater than 0 \(got {bad}\)$"):
            drafter.launch_training(config, processes=bad, with_vocab=True)
    assert calls == []
    assert main(["--config", str(config), "train", "--nproc", "0"]) == 2
    [line] = capsys.readouterr().out.strip().splitlines()
    assert line == "error: --nproc: Input should be greater than 0 (got 0)"
