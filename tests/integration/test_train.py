"""The trainer on real shards of a real (tiny) transformers target: learning, exact resume after SIGKILL, DDP,
and a run's faults (a damaged checkpoint, a second trainer, a full disk) through the real CLI."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.config import TrainConfig, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.steps.data import extract_step
from eagle3_core.steps.drafter import drafter_checkpoint_step, vocab_step
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import MetricsRow, TrainRow, ValRow
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.train.checkpoint import WEIGHTS, list_checkpoints, load_checkpoint
from eagle3_core.train.run_dir import RUNTIME_FIELDS, read_metrics
from tests.conftest import write_config
from tests.fakes import free_port

TRAIN = (
    "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, epochs: 4, lr: 0.003, log_every: 2, "
    "eval_every: 10, checkpoint_every: 10, val_fraction: 0.15, seed: 7}\n"
)


def _config(directory: Path, target: Path, train: str = TRAIN) -> Path:
    return write_config(
        directory,
        f"store: store\ndata: {{dataset: t, holdout_fraction: 0.0, shard_size: 60, sources: [{{kind: chitchat, limit: 120}}]}}\n"
        f"target: {{path: {target}}}\nregenerate: {{enabled: false}}\nextract: {{store_dtype: float32}}\n"
        # every run here trains on at most max_len (256) tokens of a sample: extracting more is never read
        "tokenize: {max_seq_len: 256}\n" + train,
    )


@pytest.fixture(scope="module")
def shard_store(tmp_path_factory: pytest.TempPathFactory, toy_target_dir: Path) -> tuple[Path, Path]:
    """(project directory with eagle3.yaml and an extracted store of 2 shards, the toy target's directory).

    The toy target, not a random one: a random target's distribution is near uniform, nothing to learn.
    """
    target_dir = toy_target_dir
    project = tmp_path_factory.mktemp("train") / "project"
    project.mkdir()
    cfg = load_config(_config(project, target_dir))
    target = TransformersTarget(target_dir, cfg.target)
    for key in ingest(cfg).all_shards:
        extract_step(cfg, key, target)
    target.close()
    return project, target_dir


def _copy(shard_store: tuple[Path, Path], dest: Path, train: str = TRAIN) -> Path:
    project, target_dir = shard_store
    shutil.copytree(project, dest)
    return _config(dest, target_dir, train)


def eagle3(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3_cli.steps", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def straight_run(
    shard_store: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """(project, its `eagle3 train`): one uninterrupted run of TRAIN, trained once for the module. The learning
    test reads it, and the SIGKILL test compares a killed-and-resumed run against it instead of training the
    same run a second time."""
    project = tmp_path_factory.mktemp("straight") / "p"
    done = eagle3(_copy(shard_store, project), "train")
    assert done.returncode == 0, done.stdout + done.stderr
    return project, done


# Two ranks, on one node or on two: 12 steps with a checkpoint every 4, so a node can be lost mid-run
TWO_RANKS = (
    "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 12, lr: 0.003, log_every: 2, "
    "eval_every: 12, checkpoint_every: 4, val_fraction: 0.15, seed: 7, optimizer: adamw, %s}\n"
)


@pytest.fixture(scope="module")
def one_node_of_two_ranks(shard_store: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project of one uninterrupted TWO_RANKS run on one node of two ranks, which the two-node runs
    (whole, and with a node lost) must end at."""
    project = tmp_path_factory.mktemp("one_node") / "p"
    done = eagle3(_copy(shard_store, project, train=TWO_RANKS % "processes: 2"), "train")
    assert done.returncode == 0, done.stdout + done.stderr
    return project


def _final_weights(project: Path) -> dict[str, torch.Tensor]:
    layout = StoreLayout(project / "store")
    final = layout.from_pointer(json.loads(layout.drafter_latest.read_text())["final"])
    return load_file(str(final / "drafter.safetensors"))


def _run_dir(project: Path) -> Path:
    [run] = list((project / "store" / "drafter" / "runs").iterdir())
    return run


def _without_timing(records: list[MetricsRow]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.dump().items() if k not in RUNTIME_FIELDS} for r in records]


def test_training_learns_and_a_finished_run_is_not_trained_again(
    straight_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    project, done = straight_run
    assert "acc_0" in done.stdout and "tau(3)" in done.stdout
    cfg = load_config(project / "eagle3.yaml")
    summary = json.loads((_run_dir(project) / "final" / "summary.json").read_text())
    records = read_metrics(_run_dir(project))
    train = [r for r in records if isinstance(r, TrainRow)]
    val = [r for r in records if isinstance(r, ValRow)]
    assert train[-1].loss < 0.9 * train[0].loss
    assert val[-1].acc[0] > 1.5 * train[0].acc[0]
    steps = cfg.train.ttt_steps
    for r in val:  # tau is 1 + the running products of the conditional accuracies
        expected, running = 1.0, 1.0
        for k in range(steps):
            running *= r.acc[k]
            expected += running
        assert len(r.tau) == steps and abs(r.tau[steps - 1] - expected) < 1e-4
        assert all(r.full_acc[k] <= r.acc[k] + 1e-9 for k in range(steps))
    vocab = vocab_step(cfg)  # the mapping `eagle3 train` built is still current: kept, not rebuilt
    assert vocab.metadata["draft_vocab_size"] == 512 and vocab.metadata["rebuilt"] is False
    again = drafter_checkpoint_step(cfg, log=lambda _: None)
    assert again.metadata["run"] == _run_dir(project).name and again.metadata["steps"] == summary["steps"]
    assert len(read_metrics(_run_dir(project))) == len(records)  # nothing trained twice


def test_sigkill_then_resume_ends_where_an_uninterrupted_run_ends(
    shard_store: tuple[Path, Path],
    straight_run: tuple[Path, subprocess.CompletedProcess[str]],
    tmp_path: Path,
) -> None:
    straight, _ = straight_run
    crashed = _copy(shard_store, tmp_path / "crashed")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3_cli.steps", "--config", str(crashed), "train"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # past the first checkpoint (step 10) and between two of them
        if line.startswith("step 14/"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run_dir = _run_dir(tmp_path / "crashed")
    assert not (run_dir / "final").exists()
    assert [step for step, _ in list_checkpoints(run_dir)] == [10]
    resumed = eagle3(crashed, "train")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming run" in resumed.stdout and "from step 10" in resumed.stdout

    a, b = _final_weights(straight), _final_weights(tmp_path / "crashed")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    assert _without_timing(read_metrics(run_dir)) == _without_timing(read_metrics(_run_dir(straight)))


def test_two_process_ddp_under_torchrun_matches_one_process(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    # AdamW: the check is of the data split and the gradient averaging, to float32 rounding. torch's Muon
    # orthogonalises each update in bfloat16, so there the two runs agree only to bf16 rounding of updates
    short = (
        "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 8, lr: 0.003, log_every: 2, "
        "eval_every: 8, checkpoint_every: 4, val_fraction: 0.15, seed: 7, optimizer: adamw}\n"
    )
    one = _copy(shard_store, tmp_path / "one", train=short)
    two = _copy(shard_store, tmp_path / "two", train=short)
    single = eagle3(one, "train")
    assert single.returncode == 0, single.stdout + single.stderr
    ddp = eagle3(two, "train", "--nproc", "2")
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    summary = json.loads((_run_dir(tmp_path / "two") / "final" / "summary.json").read_text())
    assert summary["world_size"] == 2
    a, b = _final_weights(tmp_path / "one"), _final_weights(tmp_path / "two")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
    la, lb = read_metrics(_run_dir(tmp_path / "one")), read_metrics(_run_dir(tmp_path / "two"))
    assert [(r.kind, r.step) for r in la] == [(r.kind, r.step) for r in lb]
    for ra, rb in zip(la, lb, strict=True):
        assert ra.counted == rb.counted
        assert not isinstance(ra, TrainRow) or (isinstance(rb, TrainRow) and ra.tokens == rb.tokens)
        assert abs(ra.step_losses[0] - rb.step_losses[0]) < 1e-4 and abs(ra.acc[0] - rb.acc[0]) < 1e-6


FSDP_TRAIN = (
    "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 20, lr: 0.003, log_every: 2, "
    "eval_every: 10, checkpoint_every: 10, keep_checkpoints: 4, val_fraction: 0.15, seed: 7, sharding: %s}\n"
)


def _resume_from_step_10(project: Path, dest: Path, sharding: str, target: Path) -> Path:
    """A copy of `project` whose run is cut back to its checkpoint of step 10, configured for `sharding`."""
    shutil.copytree(project, dest)
    run = _run_dir(dest)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints" / "step-00000020")
    (dest / "store" / "drafter" / "latest.json").unlink()
    return _config(dest, target, FSDP_TRAIN % sharding)


def test_fsdp_trains_as_ddp_does_and_their_checkpoints_resume_under_each_other(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    """FSDP2 (gloo, 2 ranks, Muon on the layer's matrices) against DDP: the same losses over 20 steps to
    float rounding (Muon orthogonalises in bfloat16, so updates agree to its rounding), and each run's
    checkpoint of step 10 resumed under the other sharding ends where the run itself ended."""
    runs = {}
    for sharding in ("ddp", "fsdp"):
        config = _copy(shard_store, tmp_path / sharding, train=FSDP_TRAIN % sharding)
        done = eagle3(config, "train", "--nproc", "2")
        assert done.returncode == 0, done.stdout + done.stderr
        assert ("2 process(es) on cpu, FSDP," in done.stdout) == (sharding == "fsdp"), done.stdout
        runs[sharding] = tmp_path / sharding
    ddp, fsdp = (read_metrics(_run_dir(runs[k])) for k in ("ddp", "fsdp"))
    assert [(r.kind, r.step) for r in ddp] == [(r.kind, r.step) for r in fsdp]
    assert sum(isinstance(r, TrainRow) for r in ddp) == 10  # a row every 2 steps, over 20
    for a, b in zip(ddp, fsdp, strict=True):
        assert a.counted == b.counted
        assert a.step_losses == pytest.approx(b.step_losses, rel=1e-4)
    weights = {k: _final_weights(runs[k]) for k in runs}
    assert weights["ddp"].keys() == weights["fsdp"].keys()
    for name in weights["ddp"]:
        torch.testing.assert_close(weights["ddp"][name], weights["fsdp"][name], rtol=0.02, atol=5e-3)
    # the checkpoints hold whole tensors whatever the sharding: the same names and shapes
    saved = {k: load_file(str(_run_dir(runs[k]) / "checkpoints" / "step-00000010" / WEIGHTS)) for k in runs}
    assert {n: t.shape for n, t in saved["ddp"].items()} == {n: t.shape for n, t in saved["fsdp"].items()}

    _, target = shard_store
    for saved_under, resumed_under in (("fsdp", "ddp"), ("ddp", "fsdp")):
        project = tmp_path / f"{saved_under}-then-{resumed_under}"
        config = _resume_from_step_10(runs[saved_under], project, resumed_under, target)
        done = eagle3(config, "train", "--nproc", "2")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "resuming run" in done.stdout + done.stderr and "from step 10" in done.stdout + done.stderr
        resumed = _final_weights(project)
        for name, tensor in weights[saved_under].items():
            torch.testing.assert_close(resumed[name], tensor, rtol=0.02, atol=5e-3)
        rows = read_metrics(_run_dir(project))
        original = read_metrics(_run_dir(runs[saved_under]))
        assert [(r.kind, r.step) for r in rows] == [(r.kind, r.step) for r in original]
        for a, b in zip(rows, original, strict=True):
            assert a.step_losses == pytest.approx(b.step_losses, rel=1e-4)


def _start_node(rank: int, config: Path) -> subprocess.Popen[str]:
    """`eagle3 train` as node `rank` of the config's nodes. OMP_NUM_THREADS 1 as on one node of two ranks:
    torchrun sets it itself only for several ranks a node, and a second intra-op thread sums in another order."""
    return subprocess.Popen(
        [sys.executable, "-m", "eagle3_cli.steps", "--config", str(config), "train"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "EAGLE3_NODE_RANK": str(rank), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_two_nodes_train_the_run_one_node_trains_with_the_same_world_size(
    shard_store: tuple[Path, Path], one_node_of_two_ranks: Path, tmp_path: Path
) -> None:
    """Two torchrun agents started as two nodes on 127.0.0.1 (c10d rendezvous, one gloo rank each) against
    one node of two ranks: the same batches per rank and the same averaging, so the same weights, bit for bit,
    and the same metric log."""
    one = one_node_of_two_ranks
    two = _copy(
        shard_store, tmp_path / "two", train=TWO_RANKS % f"nodes: 2, rendezvous: '127.0.0.1:{free_port()}'"
    )
    agents = [_start_node(rank, two) for rank in (0, 1)]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    assert all("--nnodes=2" in out and "--rdzv-backend=c10d" in out for out in outputs)
    assert "vocab mapping" in outputs[0] and "vocab mapping" not in outputs[1]  # node 0 built it, once
    summary = json.loads((_run_dir(tmp_path / "two") / "final" / "summary.json").read_text())
    assert summary["world_size"] == 2
    a, b = _final_weights(one), _final_weights(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    la, lb = read_metrics(_run_dir(one)), read_metrics(_run_dir(tmp_path / "two"))
    assert _without_timing(la) == _without_timing(lb)


def _kill_node(agent: subprocess.Popen[str]) -> None:
    """SIGKILL a node as a lost machine dies: its eagle3 train, its torchrun agent and the agent's ranks.
    torchrun starts each rank in a session of its own, so killing the agent's process group would leave the
    rank running as an orphan that trains on with the other node."""
    import psutil

    node = psutil.Process(agent.pid)
    for process in [node, *node.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended on its own meanwhile
            process.kill()


def test_a_node_lost_mid_run_ends_the_run_and_the_rerun_resumes_it_exactly(
    shard_store: tuple[Path, Path], one_node_of_two_ranks: Path, tmp_path: Path
) -> None:
    """Two nodes; once the first checkpoint is written, node 1 (its eagle3 train, torchrun agent and rank) is
    killed: node 0 ends with the one-line error, and both nodes started again resume from that checkpoint and
    end where one node of two ranks ends."""

    two = _copy(
        shard_store, tmp_path / "two", train=TWO_RANKS % f"nodes: 2, rendezvous: '127.0.0.1:{free_port()}'"
    )
    node0, node1 = _start_node(0, two), _start_node(1, two)
    runs = tmp_path / "two" / "store" / "drafter" / "runs"
    deadline = time.monotonic() + 300
    while not list(runs.glob("*/checkpoints/step-00000004")) and node1.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    _kill_node(node1)
    node1.communicate(timeout=60)
    out0, _ = node0.communicate(timeout=300)
    assert node0.returncode == 2, out0
    assert (
        _error_line(out0).startswith("error: torchrun training exited with status") and "every node" in out0
    )
    [run_dir] = list(runs.iterdir())
    assert not (run_dir / "final").exists() and list_checkpoints(run_dir)

    # a new rendezvous port for the rerun (the old one may linger): not part of the run's identity
    again = _config(
        tmp_path / "two", shard_store[1], TWO_RANKS % f"nodes: 2, rendezvous: '127.0.0.1:{free_port()}'"
    )
    node0, node1 = _start_node(0, again), _start_node(1, again)
    outputs = [node.communicate(timeout=600)[0] for node in (node0, node1)]
    assert [node0.returncode, node1.returncode] == [0, 0], "\n".join(outputs)
    assert any("resuming run" in out for out in outputs)
    assert [d.name for d in runs.iterdir()] == [run_dir.name]
    a, b = _final_weights(one_node_of_two_ranks), _final_weights(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert _without_timing(read_metrics(_run_dir(one_node_of_two_ranks))) == _without_timing(
        read_metrics(run_dir)
    )


def test_a_node_without_its_rank_or_a_rendezvous_is_refused_in_one_line(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    nodes = TRAIN.replace("seed: 7}", "seed: 7, nodes: 2}")
    config = _copy(shard_store, tmp_path / "p", train=nodes)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SLURM_NODEID", "JOB_COMPLETION_INDEX", "EAGLE3_NODE_RANK")
    }
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_cli.steps", "--config", str(config), "train"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 2 and "this node's rank is unknown" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_cli.steps", "--config", str(config), "train"],
        capture_output=True, text=True, timeout=300, env={**env, "EAGLE3_NODE_RANK": "0"},
    )  # fmt: skip
    assert (
        done.returncode == 2
        and "train.rendezvous: required with train.nodes > 1" in done.stdout + done.stderr
    )


def test_a_run_without_validation_samples_says_so_and_records_no_accuracy(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    none = (  # batch_tokens left at auto: the summary records the number it resolved to
        "train: {draft_vocab_size: 512, max_len: 256, max_steps: 2, log_every: 2, "
        "eval_every: 2, checkpoint_every: 2, val_fraction: 0.0}\n"
    )
    done = eagle3(_copy(shard_store, tmp_path / "p", train=none), "train")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "validation at step 2: no validation samples" in done.stdout  # the trainer's line
    assert "validation: no validation samples" in done.stdout  # the CLI's summary
    assert "tau(3)" not in done.stdout and "tau_3 1.00" not in done.stdout
    run_dir = _run_dir(tmp_path / "p")
    assert not [r for r in read_metrics(run_dir) if isinstance(r, ValRow)]
    summary = json.loads((run_dir / "final" / "summary.json").read_text())
    assert summary["val"] == {} and summary["val_samples"] == 0
    assert summary["train_config"]["batch_tokens"] == 1024  # 120 short samples: the bottom of auto's range


def test_a_batch_budget_below_one_sample_is_refused_before_training(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    tight = "train: {draft_vocab_size: 512, batch_tokens: 16, max_len: 4096, max_steps: 2}\n"
    refused = eagle3(_copy(shard_store, tmp_path / "p", train=tight), "train")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    out = " ".join(refused.stdout.split())  # the console wraps long lines
    assert re.search(r"train\.batch_tokens=16 cannot hold one sample .* train\.batch_tokens >= \d+$", out)
    assert "Traceback" not in refused.stderr
    runs = tmp_path / "p" / "store" / "drafter" / "runs"
    assert not runs.exists() or not any(runs.iterdir())


def test_a_vocab_mapping_older_than_the_shards_is_refused(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    from eagle3_core.errors import StaleVocabMappingError

    cfg = load_config(_copy(shard_store, tmp_path / "p"))
    layout = StoreLayout(cfg.store_root)
    assert vocab_step(cfg).metadata["rebuilt"] is True  # a copy of the store without one: built
    removed = layout.hidden_state_shards()[-1]
    removed.unlink()  # the shard set changes after the mapping was built
    with pytest.raises(StaleVocabMappingError):
        drafter_checkpoint_step(cfg, log=lambda _: None)


def _short(
    lr: float, init_from: str = "scratch", vocab: int = 512, steps: int = 4, head: str = "trained"
) -> str:
    return (
        f"train: {{draft_vocab_size: {vocab}, batch_tokens: 2048, max_len: 256, max_steps: {steps}, lr: {lr}, "
        f"log_every: 2, eval_every: 100, checkpoint_every: 100, val_fraction: 0.15, seed: 7, "
        f"init_from: {init_from}, head: {head}}}\n"
    )


def test_a_frozen_head_stays_the_target_s_rows_while_the_rest_learns(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    from eagle3_core.targets.head import load_target_head
    from eagle3_core.train.run_dir import load_trained

    head = load_target_head(shard_store[1])
    embed = head.embed.float()
    finals = {}
    for mode in ("frozen", "trained"):
        cfg = load_config(_copy(shard_store, tmp_path / mode, train=_short(0.003, steps=6, head=mode)))
        vocab_step(cfg)
        result = drafter_checkpoint_step(cfg, log=lambda _: None)
        finals[mode] = load_trained(result.path, embed)
        train = [r for r in read_metrics(result.path.parent) if isinstance(r, TrainRow)]
        assert train[-1].loss < train[0].loss, mode  # the rest of the drafter learns either way
    frozen, mapping, _ = finals["frozen"]
    rows = head.lm_head.float()[mapping.draft_to_target]
    assert torch.equal(frozen.lm_head.weight.detach(), rows)  # saved with the run, and never moved
    trained = finals["trained"][0].lm_head.weight.detach()
    assert (trained - rows).abs().max() > 1e-4  # the default trains it from the same rows


def test_warm_start_continues_from_the_promoted_weights_and_refuses_another_mapping(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    from eagle3_core.errors import Eagle3Error
    from eagle3_core.store.records import DrafterCurrent

    first_cfg = load_config(_copy(shard_store, tmp_path / "p", train=_short(0.003)))
    vocab_step(first_cfg)
    promoted = drafter_checkpoint_step(first_cfg, log=lambda _: None)
    layout = StoreLayout(first_cfg.store_root)
    with pytest.raises(Eagle3Error, match="no drafter is promoted yet"):
        drafter_checkpoint_step(
            load_config(_config(tmp_path / "p", shard_store[1], _short(1e-12, "current")))
        )
    run = promoted.metadata["run"]
    DrafterCurrent(  # as promote_step writes it (its export is never read: training starts from final/)
        run=run,
        export_dir=layout.pointer_path(layout.exports / run),
        acceptance_length=2.0,
        k=3,
        promoted_at="2026-12-01T00:00:00+00:00",
        replaced=None,
    ).write(layout.drafter_current)
    before = _final_weights(tmp_path / "p")

    # a vanishing learning rate: a warm run ends where the promoted run ended, a scratch run far from it
    warm = drafter_checkpoint_step(
        load_config(_config(tmp_path / "p", shard_store[1], _short(1e-12, "current", steps=1)))
    )
    assert warm.metadata["run"] != promoted.metadata["run"]
    summary = json.loads((warm.path / "summary.json").read_text())
    assert summary["warm_from"] == promoted.metadata["run"]
    after = load_file(str(warm.path / "drafter.safetensors"))
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-6)
    scratch = drafter_checkpoint_step(
        load_config(_config(tmp_path / "p", shard_store[1], _short(1e-12, steps=1)))
    )
    fresh = load_file(str(scratch.path / "drafter.safetensors"))
    assert (fresh["fc.weight"] - before["fc.weight"]).abs().max() > 1e-3  # 1000x the tolerance above

    other = load_config(_config(tmp_path / "p", shard_store[1], _short(0.003, "current", vocab=256)))
    vocab_step(other)  # another draft vocabulary: another mapping, other tokens on the lm_head rows
    with pytest.raises(Eagle3Error, match="trained with vocab mapping"):
        drafter_checkpoint_step(other, log=lambda _: None)


def test_the_drafter_assets_materialize_in_dagster_and_export_both_formats(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    import dagster as dg

    from eagle3_core.export import load_export, validate_export
    from eagle3_dagster.defs.drafter.assets import drafter_checkpoint, drafter_export, vocab_mapping
    from eagle3_dagster.defs.onpolicy.assets import drafter_refined
    from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
    from eagle3_dagster.materialize import SHARD_ASSETS

    short = (
        "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 4, log_every: 2, "
        "eval_every: 4, checkpoint_every: 4, val_fraction: 0.15}\n"
        "evaluate: {ks: [2, 5], gate_k: 5}\n"  # the speculators export's default draft length follows the gate
    )
    config = _copy(shard_store, tmp_path / "p", train=short)
    eagle3_resource = Eagle3Resource(config_path=str(config))
    result = dg.materialize(
        [*SHARD_ASSETS, vocab_mapping, drafter_checkpoint, drafter_refined, drafter_export],
        selection=[vocab_mapping, drafter_checkpoint, drafter_refined, drafter_export],
        instance=dg.DagsterInstance.ephemeral(),
        resources={"eagle3": eagle3_resource, "target": TargetResource(eagle3=eagle3_resource)},
    )
    assert result.success
    meta = {
        e.asset_key.path[-1]: e.metadata
        for e in (
            x.step_materialization_data.materialization for x in result.get_asset_materialization_events()
        )
    }
    assert meta["vocab_mapping"]["draft_vocab_size"].value == 512
    assert 0.5 < meta["vocab_mapping"]["coverage"].value <= 1.0
    assert meta["drafter_checkpoint"]["steps"].value == 4
    assert len(json.loads(meta["drafter_checkpoint"]["acc_per_position"].value)) == TrainConfig().ttt_steps
    export = meta["drafter_export"]
    assert json.loads(export["aux_layer_ids_sglang"].value) == [1, 3, 4]  # toy xs: 8 layers, aux (2, 4, 5)
    assert json.loads(export["aux_layer_ids_vllm"].value) == [2, 4, 5]
    for fmt, key in (("sglang", "sglang_dir"), ("speculators", "speculators_dir")):
        validate_export(Path(export[key].value), fmt)  # type: ignore[arg-type]
    embed = load_file(str(shard_store[1] / "model.safetensors"))["model.embed_tokens.weight"]
    loaded = load_export(Path(export["sglang_dir"].value), "sglang", embed)
    assert loaded.info.aux_layer_ids == (2, 4, 5)
    speculators = json.loads((Path(export["speculators_dir"].value) / "config.json").read_text())
    assert speculators["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5


@pytest.mark.parametrize("where", ["pipes", "k8s"])
def test_the_checkpoint_asset_trains_as_a_dagster_pipes_process(
    shard_store: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """orchestration.training pipes or k8s: drafter_checkpoint starts `eagle3 train --pipes` through Dagster's
    PipesSubprocessClient, or in a pod through dagster-k8s's PipesK8sClient (against tests/k8s_api_stub.py, a
    stand-in for a cluster, which runs the pod's command here); the trainer's log lines and its page
    (numbers, accuracy table) come back through Pipes, and the run trained is the one an in-run
    materialization would train."""
    import dagster as dg

    from eagle3_dagster.defs.drafter.assets import drafter_checkpoint, vocab_mapping
    from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
    from eagle3_dagster.materialize import SHARD_ASSETS
    from tests.k8s_api_stub import KubernetesApiStub

    with contextlib.ExitStack() as stack:
        orchestration = "{training: pipes}"
        if where == "k8s":
            stub = stack.enter_context(KubernetesApiStub())
            kubeconfig = stub.kubeconfig(tmp_path / "kubeconfig")
            orchestration = (
                f"{{training: k8s, k8s: {{image: 'eagle3:test', namespace: ml, kubeconfig: '{kubeconfig}', "
                f"volumes: {{'{tmp_path}': project, '{shard_store[1]}': toy-target}}}}}}"
            )
            # the pod's `python` is the image's; here, the one running the tests
            monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        short = (
            "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 4, log_every: 2, "
            f"eval_every: 4, checkpoint_every: 4, val_fraction: 0.15, device: cpu}}\norchestration: {orchestration}\n"
        )
        config = _copy(shard_store, tmp_path / "p", train=short)
        eagle3_resource = Eagle3Resource(config_path=str(config))
        instance = dg.DagsterInstance.ephemeral()
        result = dg.materialize(
            [*SHARD_ASSETS, vocab_mapping, drafter_checkpoint],
            selection=[vocab_mapping, drafter_checkpoint],
            instance=instance,
            resources={"eagle3": eagle3_resource, "target": TargetResource(eagle3=eagle3_resource)},
        )
    assert result.success
    [event] = [
        e.step_materialization_data.materialization
        for e in result.get_asset_materialization_events()
        if e.asset_key == drafter_checkpoint.key
    ]
    meta = event.metadata
    assert meta["steps"].value == 4 and meta["run"].value == _run_dir(tmp_path / "p").name
    assert "| position | val acc |" in str(meta["accuracy"].value)
    logs = [r.user_message for r in instance.all_logs(result.run_id)]
    assert any("training run" in m for m in logs), "the trainer's log lines did not come back through Pipes"
    assert (_run_dir(tmp_path / "p") / "final" / "summary.json").exists()
    if where == "k8s":
        [pod] = stub.created
        [container] = pod["spec"]["containers"]
        assert container["command"][-2:] == ["train", "--pipes"] and pod["metadata"]["namespace"] == "ml"
        assert "resources" not in container  # train.device cpu: no GPU asked for
        assert stub.deleted == [pod["metadata"]["name"]]


def test_batches_hold_the_stored_rows_cut_to_max_len_and_zero_padding(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    from eagle3_core.errors import ShardCorruptError
    from eagle3_core.train.data import TrainingData

    project, _ = shard_store
    data = TrainingData(StoreLayout(project / "store").hidden_state_shards())
    refs = sorted(data.refs, key=lambda r: r.length)[-3:]  # the longest, so max_len cuts
    batch = data.load_batch(refs, max_len=200)
    assert batch.input_ids.dtype == torch.int64 and batch.tokens == sum(min(r.length, 200) for r in refs)
    for i, ref in enumerate(refs):
        sample = data.readers[ref.shard].sample(ref.index)
        n = min(ref.length, 200)
        assert torch.equal(batch.input_ids[i, :n], sample.input_ids[:n].long())
        assert torch.equal(batch.aux[i, :n], sample.aux_hidden_states[:n])
        assert torch.equal(batch.last[i, :n], sample.last_hidden_states[:n])
        assert not batch.loss_mask[i, n:].any() and not batch.aux[i, n:].any()
    data.close()
    # one flipped byte in a sample's hidden states: its batch is refused, even when the byte lies past max_len
    shard = StoreLayout(tmp_path).root
    shutil.copytree(project / "store", shard / "store")
    path = StoreLayout(shard / "store").hidden_state_shards()[0]
    data = TrainingData([path])
    ref = max(data.refs, key=lambda r: r.length)
    reader = data.readers[0]
    first = int(reader._offsets[reader._index[ref.index]])
    entry = reader.header["last_hidden_states"]
    offset = reader._data_start + entry["data_offsets"][0] + (first + ref.length - 1) * 4 * 128
    data.close()
    blob = bytearray(path.read_bytes())
    blob[offset] ^= 0xFF
    path.write_bytes(bytes(blob))
    data = TrainingData([path])
    with pytest.raises(ShardCorruptError):
        data.load_batch([ref], max_len=16)
    data.close()


# ---- a run's faults: damaged checkpoints, a second trainer, a full disk --------------------------------------
SHORT = (
    "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 2, lr: 0.003, log_every: 1, "
    "eval_every: 100, checkpoint_every: 1, val_fraction: 0.15, seed: 7}\n"
)
TRAIN_MAIN = "\nfrom eagle3_cli.steps import main\nsys.exit(main(['--config', sys.argv[1], 'train']))\n"
KILLED_BEFORE_FINAL = """
import os, signal, sys
import eagle3_core.train.trainer as trainer
trainer.write_final = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # after the last checkpoint
"""
PAUSED_AFTER_A_STEP = """
import sys
import eagle3_core.train.trainer as trainer
real, paused = trainer.train_step, []
def train_step(*args):
    stats = real(*args)
    if not paused:  # holds the run here, mid-training, until the test sends a line
        paused.append(True)
        print("paused", flush=True)
        sys.stdin.readline()
    return stats
trainer.train_step = train_step
"""
DISK_FULL_AT_STEP_2 = """
import errno, os, sys
real_fsync = os.fsync
def fsync(fd):  # where a full disk shows up under delayed allocation: flushing the written file
    if ".step-00000002.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_fsync(fd)
os.fsync = fsync
"""

DISK_FULL_IN_THE_METRIC_LOG_AT_STEP_2 = """
import builtins, errno, os, sys
import eagle3_core.train.run_dir as run_dir

class FillsUp:  # the metric log's file: the disk fills up half way through step 2's row, as a kernel does it
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def __getattr__(self, name):
        return getattr(self.f, name)
    def write(self, data):
        if b'"kind": "train", "step": 2,' in (data.encode() if isinstance(data, str) else bytes(data)):
            self.f.write(data[: len(data) // 2])  # what fitted
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)

def open_(path, mode="r", *args, **kwargs):  # the run directory module's own `open`, nothing else's
    f = builtins.open(path, mode, *args, **kwargs)
    return FillsUp(f) if str(path).endswith("metrics.jsonl") and "a" in mode else f
run_dir.open = open_
"""


def _train_child(config: Path, fault: str) -> subprocess.CompletedProcess[str]:
    """`eagle3 train` in a child interpreter that first runs `fault`: a fault at a real point of a real run."""
    return subprocess.run(
        [sys.executable, "-c", fault + TRAIN_MAIN, str(config)], capture_output=True, text=True, timeout=600
    )


def _squeezed(text: str) -> str:
    """`text` without whitespace: the console wraps long log lines, paths included."""
    return "".join(text.split())


def _error_line(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("error:")]
    return line


def _logged_steps(run_dir: Path) -> list[tuple[str, int]]:
    return [(r.kind, r.step) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def cut_short(shard_store: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose run was killed after its last checkpoint and before final/: checkpoints 1 and 2."""
    project = tmp_path_factory.mktemp("cut") / "p"
    killed = _train_child(_copy(shard_store, project, SHORT), KILLED_BEFORE_FINAL)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert [step for step, _ in list_checkpoints(_run_dir(project))] == [1, 2]
    return project


def _truncate(path: Path) -> tuple[str, str]:
    """Cut the file in half: (what a resume says of it, the reason it is set aside with)."""
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return f"truncated ({size // 2:,} bytes on disk, {size:,} written)", "truncated"


def _flip_a_bit(path: Path) -> tuple[str, str]:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # safetensors: the data comes last, so the last byte is a weight's
    path.write_bytes(bytes(data))
    return "fails its checksum (its tensors hash to ", "checksum"


@pytest.mark.parametrize("damage", [_truncate, _flip_a_bit])
def test_a_damaged_last_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
    cut_short: Path, tmp_path: Path, damage: Callable[[Path], tuple[str, str]]
) -> None:
    project = tmp_path / "p"
    shutil.copytree(cut_short, project)
    run_dir = _run_dir(project)
    weights = run_dir / "checkpoints" / "step-00000002" / WEIGHTS
    what, reason = damage(weights)
    damaged = weights.read_bytes()
    resumed = eagle3(project / "eagle3.yaml", "train")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "Traceback" not in resumed.stderr
    out = _squeezed(resumed.stdout)
    assert _squeezed(f"{weights}: {what}") in out
    assert _squeezed(f"the checkpoint of step 2 is set aside as step-00000002.{reason}") in out
    assert _squeezed(f"resuming run {run_dir.name} from step 1") in out
    aside = run_dir / "checkpoints" / f"step-00000002.{reason}"
    assert (aside / WEIGHTS).read_bytes() == damaged  # kept as it was: nothing is lost
    assert [step for step, _ in list_checkpoints(run_dir)] == [1, 2]  # step 2 trained and saved again
    assert load_checkpoint(run_dir / "checkpoints" / "step-00000002").verified
    assert (run_dir / "final" / "summary.json").exists()
    assert _logged_steps(run_dir) == [("train", 1), ("train", 2), ("val", 2)]  # step 2 logged once


def test_a_second_trainer_of_a_running_run_is_refused_naming_the_first_one(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    config = _copy(shard_store, tmp_path / "p", SHORT)
    first = subprocess.Popen(
        [sys.executable, "-c", PAUSED_AFTER_A_STEP + TRAIN_MAIN, str(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert first.stdout is not None
        assert any(line.strip() == "paused" for line in first.stdout), "the first trainer ended unpaused"
        run = _run_dir(tmp_path / "p").name
        holder = f"training run {run} is being written by another process (pid {first.pid};"
        second = eagle3(config, "train")
        assert second.returncode == 2, second.stdout + second.stderr
        assert holder in _error_line(second.stdout) and "Traceback" not in second.stderr
        # under torchrun too: rank 0 is refused, every rank stops (none waits for it), the launch fails
        ddp = eagle3(config, "train", "--nproc", "2")
        assert ddp.returncode == 2, ddp.stdout + ddp.stderr
        assert f"error: {holder}" in ddp.stderr
        assert _error_line(ddp.stdout).startswith("error: torchrun training exited with status 1 (")
    finally:
        rest, _ = first.communicate("\n", timeout=600)
    assert first.returncode == 0, rest
    assert _logged_steps(_run_dir(tmp_path / "p")) == [("train", 1), ("train", 2), ("val", 2)]


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_run_resumes_from_the_previous_one(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    config = _copy(shard_store, tmp_path / "p", SHORT)
    full = _train_child(config, DISK_FULL_AT_STEP_2)
    assert full.returncode == 2, full.stdout + full.stderr
    assert "Traceback" not in full.stderr
    run_dir = _run_dir(tmp_path / "p")
    line = _error_line(full.stdout)
    assert line.startswith(
        f"error: {run_dir}: the disk filled up while writing the checkpoint of step 2 (No space left on device); "
    )
    assert re.search(r"and the disk has [\d,]+ bytes \(\d+\.\d\d GiB\) free", line)
    assert line.endswith("free space, then train again (it resumes from step 1)")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000001"]  # no half-written one
    assert load_checkpoint(run_dir / "checkpoints" / "step-00000001").verified
    resumed = eagle3(config, "train")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _squeezed(f"resuming run {run_dir.name} from step 1") in _squeezed(resumed.stdout)
    assert _logged_steps(run_dir) == [("train", 1), ("train", 2), ("val", 2)]


def test_a_full_disk_in_the_metric_log_is_one_line_leaves_whole_rows_and_the_run_resumes(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    config = _copy(shard_store, tmp_path / "p", SHORT)
    full = _train_child(config, DISK_FULL_IN_THE_METRIC_LOG_AT_STEP_2)
    assert full.returncode == 2, full.stdout + full.stderr
    assert "Traceback" not in full.stderr
    run_dir = _run_dir(tmp_path / "p")
    line = _error_line(full.stdout)
    assert line.startswith(
        f"error: {run_dir}: the disk filled up while writing the train row of step 2 to metrics.jsonl "
        "(No space left on device); "
    )
    assert line.endswith("free space, then train again (it resumes from step 1)")
    assert _logged_steps(run_dir) == [("train", 1)]  # step 2's row is not there in part
    resumed = eagle3(config, "train")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _squeezed(f"resuming run {run_dir.name} from step 1") in _squeezed(resumed.stdout)
    assert _logged_steps(run_dir) == [("train", 1), ("train", 2), ("val", 2)]


def test_fp8_shards_train_alone_or_beside_float32_ones(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    """extract.store_dtype fp8_e4m3: a batch of FP8 shards crosses as stored and is dequantised by Batch.to; a
    store where one shard is FP8 and one float32 (re-extracted in FP8 after a change of settings) trains too."""
    from eagle3_core.store.fp8 import FP8
    from eagle3_core.train.data import TrainingData

    config = _copy(shard_store, tmp_path / "p", train=_short(0.003, steps=6))
    config.write_text(config.read_text().replace("store_dtype: float32", "store_dtype: fp8_e4m3"))
    cfg = load_config(config)
    target = TransformersTarget(shard_store[1], cfg.target)
    keys = ingest(cfg).all_shards
    extract_step(cfg, keys[0], target)  # the first shard (59 samples) in FP8; the second stays float32
    target.close()
    paths = StoreLayout(cfg.store_root).hidden_state_shards()
    data = TrainingData(paths)
    fp8 = [r for r in data.refs if data.readers[r.shard].quantized][:3]
    plain = [r for r in data.refs if not data.readers[r.shard].quantized][:1]
    assert len(fp8) == 3 and len(plain) == 1
    stored = data.load_batch(fp8, max_len=256)
    assert stored.aux.dtype == FP8 and stored.scales is not None  # one byte a value in host memory
    on_device = stored.to(torch.device("cpu"))
    mixed = data.load_batch([*fp8[:1], *plain], max_len=256)
    assert mixed.aux.dtype == torch.float32 and mixed.scales is None  # the FP8 sample dequantised into it
    for i, ref in enumerate(fp8):
        sample = data.readers[ref.shard].sample(ref.index)
        assert torch.equal(on_device.aux[i, : ref.length], sample.aux_hidden_states)
        assert torch.equal(on_device.last[i, : ref.length], sample.last_hidden_states)
        assert not on_device.aux[i, ref.length :].any()
    first = data.readers[fp8[0].shard].sample(fp8[0].index).aux_hidden_states.float()
    assert torch.allclose(mixed.aux[0, : fp8[0].length], first, rtol=1 / 128, atol=0)
    data.close()
    stats = eagle3(config, "stats")
    assert stats.returncode == 0, stats.stderr
    [line] = [x for x in stats.stdout.splitlines() if x.startswith("bytes per token:")]
    per_token = {d: float(n.replace(",", "")) for n, d in re.findall(r"([\d,]+) in (\w+)", line)}
    assert set(per_token) == {"float32", "fp8_e4m3"} and per_token["fp8_e4m3"] < per_token["float32"] / 3
    vocab_step(cfg)
    result = drafter_checkpoint_step(cfg, log=lambda _: None)
    train = [r for r in read_metrics(result.path.parent) if isinstance(r, TrainRow)]
    assert train[-1].loss < train[0].loss


CONVERT_KILLED = """
import os, signal, sys
import eagle3_core.store.shards as shards
from eagle3_cli.steps import main
where, real_write, real_replace, written = sys.argv[2], shards.ShardWriter.write_sample, os.replace, []

def write_sample(self, *args, **kwargs):  # in the second shard's rows
    written.append(self.path.stem)
    if where == "rows" and len(set(written)) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(self, *args, **kwargs)

def replace(src, dst):  # between the in-place commit's two renames: the new shard in, its manifest not yet
    if where == "renames" and str(dst).endswith(".json") and os.path.basename(str(dst)).startswith("t-00000"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)

shards.ShardWriter.write_sample = write_sample
shards.os.replace = replace
sys.exit(main(['--config', sys.argv[1], 'convert-shards', '--to', 'fp8_e4m3']))
"""


@pytest.mark.parametrize("killed_in", ["rows", "renames"])
def test_convert_shards_halves_a_store_survives_sigkill_and_the_rerun_finishes(
    shard_store: tuple[Path, Path], tmp_path: Path, killed_in: str
) -> None:
    from eagle3_core.store.shards import read_shard_header
    from eagle3_core.store.stats import verify_shard

    config = _copy(shard_store, tmp_path / "p")
    cfg = load_config(config)
    paths = StoreLayout(cfg.store_root).hidden_state_shards()
    before = {p.stem: (p.stat().st_size, _all_samples(p)) for p in paths}
    # a first conversion to bfloat16 (4 bytes -> 2 a value), then SIGKILL in the FP8 conversion's second shard
    assert eagle3(config, "convert-shards", "--to", "bfloat16").returncode == 0
    killed = subprocess.run(
        [sys.executable, "-c", CONVERT_KILLED, str(config), killed_in],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    dtypes = [read_shard_header(p).store_dtype for p in paths]
    if killed_in == "rows":  # the first converted, the second still whole in its old dtype
        assert dtypes == ["fp8_e4m3", "bfloat16"] and all(verify_shard(p).ok for p in paths)
    else:  # the first shard converted, its manifest still the old one: named, and the rerun rewrites it
        assert dtypes == ["fp8_e4m3", "bfloat16"]
        assert [pr for pr in verify_shard(paths[0]).problems if "manifest" in pr]
    rerun = eagle3(config, "convert-shards", "--to", "fp8_e4m3")
    assert rerun.returncode == 0, rerun.stderr
    assert f"{paths[0].stem}: already fp8_e4m3" in rerun.stdout + rerun.stderr
    for p in paths:
        assert verify_shard(p).ok
        ids, rows = _all_samples(p)
        assert ids == before[p.stem][1][0]  # every sample, in order, none lost or doubled
        for got, want in zip(rows, before[p.stem][1][1], strict=True):
            assert torch.equal(got[0], want[0])  # the tokens exactly
            blocks = want[1].view(want[1].shape[0], 3, -1)
            bound = (
                blocks.abs() / 16 + blocks.abs().amax(-1, keepdim=True) / 448 * 2.0**-10 + blocks.abs() / 64
            )
            assert bool(((got[1].float().view_as(blocks) - blocks).abs() <= bound).all())
        assert p.stat().st_size < 0.3 * before[p.stem][0]  # float32 -> FP8: about a quarter, with the scales
    assert eagle3(config, "convert-shards", "--to", "fp8_e4m3").stdout.count("already fp8_e4m3") == len(paths)


def _all_samples(path: Path) -> tuple[list[str], list[tuple[torch.Tensor, torch.Tensor]]]:
    from eagle3_core.store.shards import ShardReader

    with ShardReader(path) as r:
        samples = [r.sample(i) for i in range(len(r))]
        return r.sample_ids, [(s.input_ids.clone(), s.aux_hidden_states.float().clone()) for s in samples]


BROKEN_EXPORT = """
import sys
import eagle3_core.export.sglang as sglang
from eagle3_cli.steps import main
real = sglang.SGLangFormat.build_config

def broken(self, *args, **kwargs):  # a config field the weights contradict, as a wrong key mapping would write
    config = real(self, *args, **kwargs)
    return config.model_copy(update={"num_key_value_heads": config.num_key_value_heads + 1})

sglang.SGLangFormat.build_config = broken
sys.exit(main(['--config', sys.argv[1], *sys.argv[2:]]))
"""


def test_a_run_exports_its_drafter_before_the_first_step_and_a_broken_export_stops_it(
    shard_store: tuple[Path, Path], tmp_path: Path
) -> None:
    config = _copy(shard_store, tmp_path / "p", train=_short(0.003, steps=2))
    runs = load_config(config).store_root / "drafter"
    dry = eagle3(config, "train", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "both exports of the drafter as initialised are valid; nothing was trained" in dry.stdout
    assert not list(runs.glob("runs/*/metrics.jsonl"))  # nothing trained
    assert not list((load_config(config).store_root / "run").glob("dry-run-*"))  # the scratch export removed
    for args in (["train", "--dry-run"], ["train"]):
        broken = subprocess.run(
            [sys.executable, "-c", BROKEN_EXPORT, str(config), *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert broken.returncode == 2, broken.stdout[-2000:] + broken.stderr[-2000:]
        [line] = [x for x in (broken.stdout + broken.stderr).splitlines() if x.startswith("error: ")]
        assert "(sglang export): inconsistent drafter config" in line and "num_kv_heads" in line, line
        assert "Traceback" not in broken.stdout + broken.stderr
        assert not list(runs.glob("runs/*/metrics.jsonl"))  # refused before any step
