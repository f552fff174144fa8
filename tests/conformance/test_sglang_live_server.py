"""SGLang 0.5.23's own `launch_server`, live on a CPU, started by eagle3: the `hidden_states` asset materialised
in Dagster with `target.backend: sglang_server` reaps the server a crashed run left, launches SGLang from
eagle3's extraction command (`--device cpu`, the capture hooks), waits for its health, extracts the shard
over HTTP and stops the server at teardown. Every stored row equals what transformers computes on the same
ids (float32), each aux the input of its own layer.

The server runs beside SGLang's code (conftest.py's sglang_env, on the server's PYTHONPATH only)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import torch

from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.engines.sglang_server import SGLangServer, proc_stat
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.hf import TransformersTarget
from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
from eagle3_dagster.materialize import SHARD_ASSETS, add_shard_partitions
from tests.conformance.conftest import sglang_env
from tests.conformance.families import FP32_REL, H, rel_diff
from tests.conftest import FIXTURES, write_config
from tests.fakes import free_port
from tests.helpers import save_tiny_chat_target

AUX = (1, 4, 6)


def _alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st.state != "Z"


def _crashed_run_left_a_server(cfg_path: Path) -> int:
    """A process started by eagle3's SGLangServer as a run starts its server, whose run then died (the PID
    file's owner has exited). Its PID."""
    cfg = load_config(cfg_path)
    server = SGLangServer(cfg.sglang, StoreLayout(cfg.store_root))
    record = server.start(["sleep", "600"])
    owner = subprocess.Popen(["true"])
    owner.wait()
    record.model_copy(update={"owner_pid": owner.pid, "owner_start_ticks": 1}).write(server.pid_file)
    return record.pid


def test_the_hidden_states_asset_extracts_through_a_managed_sglang_server(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", sglang_env()["PYTHONPATH"]
    )  # the server's; this process never imports it
    target = save_tiny_chat_target(tmp_path / "target", hidden=H)
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    sglang = {
        "launcher": [sys.executable, "-m", "sglang.launch_server"],
        "port": free_port(),
        "mem_fraction_static": 0.5,
        "max_total_tokens": 4096,
        "startup_timeout_s": 300,
    }
    config_path = write_config(
        tmp_path,
        "store: store\ndata: {dataset: fx, holdout_fraction: 0.0, sources: [{path: rows.jsonl}]}\n"
        f"target: {{path: {target}, device: cpu, dtype: float32, aux_layer_ids: {list(AUX)}, "
        "backend: sglang_server}\n"
        "regenerate: {max_new_tokens: 6, batch_size: 4}\ntokenize: {max_seq_len: 256}\n"
        f"extract: {{store_dtype: float32}}\nsglang: {json.dumps(sglang)}\n",
    )
    cfg = load_config(config_path)
    stale = _crashed_run_left_a_server(config_path)
    [key] = ingest(cfg).all_shards
    add_shard_partitions(instance, [key])
    eagle3 = Eagle3Resource(config_path=str(config_path))

    result = dg.materialize(
        SHARD_ASSETS,
        partition_key=key,
        instance=instance,
        resources={"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)},
    )

    assert result.success
    assert not _alive(stale)  # reaped before the launch
    messages = [e.message for e in instance.all_logs(result.run_id)]
    [started] = [m for m in messages if m.startswith("SGLang server started: pid ")]
    server_pid = int(re.match(r"SGLang server started: pid (\d+)", started)[1])  # type: ignore[index]
    layout = StoreLayout(cfg.store_root)
    assert not _alive(server_pid) and not layout.sglang_pid_file(socket.gethostname()).exists()  # stopped
    command = layout.sglang_log(socket.gethostname()).read_text().splitlines()[0]
    assert "--device cpu --attention-backend torch_native" in command and "--forward-hooks" in command

    meta = {
        e.step_materialization_data.materialization.asset_key.path[-1]: (
            e.step_materialization_data.materialization.metadata
        )
        for e in result.get_asset_materialization_events()
    }
    hidden = meta["hidden_states"]
    assert hidden["samples"].value == meta["regenerated"]["samples"].value > 0
    assert hidden["errors"].value == 0
    reference = TransformersTarget(target, cfg.target)
    model = reference.model
    with ShardReader(Path(hidden["path"].value)) as shard:
        assert shard.verify() == []
        samples = [(s.sample_id, s.input_ids.clone(), s.aux_hidden_states.clone(), s.last_hidden_states.clone())
                   for s in shard]  # fmt: skip
    want = reference.hidden_states([ids.tolist() for _, ids, _, _ in samples], torch.float32)
    for (sample_id, _, aux, last), w in zip(samples, want, strict=True):
        assert isinstance(w, HiddenStates)
        assert rel_diff(last, w.last) < FP32_REL, sample_id
        assert rel_diff(aux, w.aux) < FP32_REL, sample_id
    # each aux block is the input of its own layer, not a neighbour's (SGLang's +1 rule undone by the hooks)
    _, ids, aux, _ = samples[0]
    with torch.inference_mode():
        layers = model(ids.long()[None], output_hidden_states=True).hidden_states
    for j, k in enumerate(AUX):
        block = aux[:, j * H : (j + 1) * H]
        assert rel_diff(block, layers[k][0]) < FP32_REL, k
        assert min(rel_diff(block, layers[k - 1][0]), rel_diff(block, layers[k + 1][0])) > 1000 * FP32_REL, k
