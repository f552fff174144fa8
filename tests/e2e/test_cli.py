"""The `eagle3` command end to end on the toy target: ingest, regenerate, extract, stats, verify."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import write_config
from tests.parquet_files import unreadable_parquet

SMALL_DATA = "data: {dataset: cc, shard_size: 12, sources: [{kind: chitchat, limit: 12}]}\n"


def eagle3(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3_cli.main", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_pipeline_on_the_toy_target(tmp_path: Path, toy_target_dir: Path) -> None:
    config = write_config(
        tmp_path,
        f"store: store\ndata: {{dataset: cc, shard_size: 12, sources: [{{kind: chitchat, limit: 30}}]}}\n"
        f"target: {{path: {toy_target_dir}}}\n"
        "regenerate: {max_new_tokens: 16, max_turns: 2, batch_size: 16}\ntokenize: {max_seq_len: 80}\n",
    )
    assert eagle3(config, "ingest").returncode == 0
    regen = eagle3(config, "regenerate")
    assert regen.returncode == 0, regen.stdout + regen.stderr
    extract = eagle3(config, "extract")
    assert extract.returncode == 0, extract.stdout + extract.stderr
    assert "nothing to do" in eagle3(config, "extract").stdout  # done shards are not redone

    stats = json.loads(eagle3(config, "stats", "--json").stdout)
    conversations = stats["conversations"]
    assert sorted(stats["shards"]) == ["cc-00000", "cc-00001", "cc-00002"]
    assert 0 < stats["totals"]["samples"] <= conversations
    # regeneration stops a conversation whose prompt no longer leaves room for a reply, so nothing is truncated
    assert "stopped_context_limit=" in regen.stdout
    assert stats["totals"]["truncated_samples"] == 0
    assert stats["totals"]["tokens"] > stats["totals"]["loss_tokens"] > 0

    verify = eagle3(config, "verify")
    assert verify.returncode == 0 and "3/3 shards ok" in verify.stdout
    shard = tmp_path / "store" / "hidden_states" / "cc-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(bytes(raw))
    verify = eagle3(config, "verify")
    assert verify.returncode == 1
    assert "cc-00001" in verify.stdout and "2/3 shards ok" in verify.stdout


def test_cli_names_the_bad_field(tmp_path: Path) -> None:
    config = write_config(tmp_path, "tokenize: {max_seq_len: 4}\n")
    result = eagle3(config, "ingest")
    assert result.returncode == 2
    assert "tokenize.max_seq_len" in result.stdout


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """A refused input: exit 2, one line on stdout, no traceback anywhere."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stdout
    return lines[0]


def test_a_store_path_where_a_file_is_is_refused_by_ingest_verify_and_extract(tmp_path: Path) -> None:
    taken = tmp_path / "store"
    taken.write_text("a user's file, never to be touched\n")
    config = write_config(tmp_path, f"store: store\n{SMALL_DATA}")
    # the commands of the report: ingest gave a traceback, verify and extract exit 0 on an empty store; the
    # others load the config the same way (tests/unit/test_config.py checks the message)
    for command in ("ingest", "verify", "extract"):
        line = _one_error_line(eagle3(config, command))
        assert f"store: {taken} is a file" in line, (command, line)
    assert taken.read_text() == "a user's file, never to be touched\n"


def test_a_config_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "eagle3.yaml"
    config.write_bytes(f"store: st\u00f6re\n{SMALL_DATA}".encode("latin-1"))
    line = _one_error_line(eagle3(config, "ingest"))
    assert line == f"error: {config}: not UTF-8 text (invalid start byte at byte 9); save it as UTF-8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3.yaml"]  # nothing was written


def test_a_config_json_whose_layer_sizes_disagree_with_the_weights_is_refused_at_load(
    tmp_path: Path, toy_target_dir: Path
) -> None:
    """intermediate_size names no tensor outside the layers: transformers finds the disagreement as it
    loads, and eagle3 turns its report into one line naming the tensor and both shapes."""
    target = tmp_path / "target"
    shutil.copytree(toy_target_dir, target)
    config_json = target / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "intermediate_size": 256}))
    config = write_config(tmp_path, f"store: store\n{SMALL_DATA}target: {{path: {target}, device: cpu}}\n")
    assert eagle3(config, "ingest").returncode == 0
    line = _one_error_line(eagle3(config, "regenerate"))
    assert line == (
        f"error: {config_json}: its sizes disagree with the weights: model.layers.0.mlp.down_proj.weight has "
        "shape [128, 384] in the weights, where the config makes it [128, 256] (and 23 more tensors)"
    )


def _conversation_line(content: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": content}]}) + "\n"


def test_a_source_pattern_matching_a_file_of_another_kind_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(_conversation_line("q 0"))
    (tmp_path / "data" / "notes.txt").write_text("the user's notes, beside the conversations\n")
    config = write_config(tmp_path, "store: store\ndata: {dataset: t, sources: [{path: 'data/*'}]}\n")
    line = _one_error_line(eagle3(config, "ingest"))
    assert line == (
        "error: data.sources[0].path: 'data/*' matches data/notes.txt, which is not a .jsonl, .json or "
        ".parquet file; narrow the pattern to the conversation files"
    )
    assert not (tmp_path / "store" / "ledger.json").exists()  # refused before a row was read


def test_a_parquet_source_that_cannot_be_decoded_is_refused_in_one_line_and_the_shards_before_it_stand(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.jsonl").write_text(_conversation_line("q 0"))
    unreadable_parquet(tmp_path / "b.parquet", "duration_out_of_range")
    config = write_config(
        tmp_path, "store: store\ndata: {dataset: t, sources: [{path: a.jsonl}, {path: b.parquet}]}\n"
    )
    result = eagle3(config, "ingest")
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    made, refused = result.stdout.strip().splitlines()  # the shard a.jsonl made, then one line for b.parquet
    assert made == "t-00000: 1 samples, 0 rejected (a.jsonl)"
    assert refused.startswith("error: b.parquet: not readable as Parquet (OverflowError: ")
    ledger = json.loads((tmp_path / "store" / "ledger.json").read_text())
    assert ledger["sources"]["a.jsonl"]["shards"] == ["t-00000"] and "b.parquet" not in ledger["sources"]
