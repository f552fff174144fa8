import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.errors import DiskSpaceError
from eagle3_core.store.records import ShardFacts
from eagle3_core.store.shards import (
    ShardCorruptError,
    ShardReader,
    ShardWriter,
    estimate_shard_bytes,
)
from eagle3_core.store.stats import store_stats, verify_shard

H = 16


def _samples(lengths: list[int], seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32),
            torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8),
            torch.randn(n, 3 * H, generator=g),
            torch.randn(n, H, generator=g),
        )
        for n in lengths
    ]


def _write(
    path: Path, lengths: list[int], dtype: str = "float32", order: list[int] | None = None
) -> list[tuple[torch.Tensor, ...]]:
    data = _samples(lengths)
    ids = [f"{i:064x}" for i in range(len(lengths))]
    with ShardWriter(
        path,
        sample_ids=ids,
        lengths=lengths,
        hidden_size=H,
        store_dtype=dtype,
        facts=ShardFacts(aux_layer_ids=[2, 4, 5]),
    ) as w:
        for i in order or range(len(lengths)):
            w.write_sample(i, *data[i])
        w.finalize({"truncated_samples": 1})
    return data


def test_round_trip_out_of_order_and_readable_by_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "hidden_states" / "t-00000.safetensors"
    lengths = [7, 3, 11, 1]
    data = _write(path, lengths, order=[2, 0, 3, 1])
    with ShardReader(path) as r:
        assert len(r) == 4 and r.lengths == lengths
        for i, (ids, mask, aux, last) in enumerate(data):
            s = r.sample(i)
            assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask)
            assert torch.equal(s.aux_hidden_states, aux) and torch.equal(s.last_hidden_states, last)
        assert r.verify() == []
    tensors = load_file(str(path))  # the reference safetensors reader agrees
    assert tensors["offsets"].tolist() == [0, 7, 10, 21, 22]
    assert torch.equal(tensors["aux_hidden_states"][10:21], data[2][2])
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["counts"] == {
        "truncated_samples": 1,
        "samples": 4,
        "tokens": 22,
        "loss_tokens": sum(int(d[1].sum()) for d in data),
        "failed": 0,
    }
    assert manifest["lengths"] == lengths and "sample_digests" not in manifest


def test_bf16_storage(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    data = _write(path, [5, 4], dtype="bfloat16")
    with ShardReader(path) as r:
        s = r.sample(1)
        assert s.aux_hidden_states.dtype == torch.bfloat16
        assert torch.equal(s.aux_hidden_states, data[1][2].to(torch.bfloat16))


def test_failed_samples_are_invisible_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    data = _samples([4, 5, 6])
    ids = [f"{i:064x}" for i in range(3)]
    with ShardWriter(path, sample_ids=ids, lengths=[4, 5, 6], hidden_size=H, store_dtype="float32") as w:
        w.write_sample(0, *data[0])
        w.mark_failed(1, "fewer hidden-state rows than tokens")
        w.write_sample(2, *data[2])
        manifest = w.finalize()
    assert manifest.counts.samples == 2 and manifest.counts.failed == 1
    assert manifest.failed == {ids[1]: "fewer hidden-state rows than tokens"}
    with ShardReader(path) as r:
        assert r.sample_ids == [ids[0], ids[2]]
        assert torch.equal(r.sample(1).aux_hidden_states, data[2][2])


def test_unfinished_writer_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    with (
        pytest.raises(RuntimeError, match="never written"),
        ShardWriter(path, sample_ids=["a" * 64, "b" * 64], lengths=[2, 2], hidden_size=H) as w,
    ):
        w.write_sample(0, *_samples([2])[0])
        w.finalize()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["header", "offsets", "tensor_data", "last_byte"])
def test_one_flipped_byte_is_found_by_verify_and_refused_by_the_reader(tmp_path: Path, where: str) -> None:
    path = tmp_path / "t-00000.safetensors"
    _write(path, [6, 9, 4])
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    position = {
        "header": 8 + header_len // 3,
        "offsets": 8 + header_len + 9,
        "tensor_data": 8 + header_len + 4 * 8 + 4 * 19 + 100,
        "last_byte": len(raw) - 1,
    }[where]
    raw[position] ^= 0x01
    path.write_bytes(bytes(raw))
    assert not verify_shard(path).ok
    with pytest.raises(ShardCorruptError), ShardReader(path) as r:
        for i in range(len(r)):
            r.sample(i)


def test_truncated_shard_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    _write(path, [6, 9])
    path.write_bytes(path.read_bytes()[:-10])
    result = verify_shard(path)
    assert not result.ok and "bytes on disk" in result.problems[0]
    with pytest.raises(ShardCorruptError):
        ShardReader(path)


def test_disk_preflight_names_bytes_needed_and_free(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    tokens = int(free / (4 * 4 * H)) + 1000  # float32 rows of 4H: more than the disk holds
    with pytest.raises(DiskSpaceError, match=r"needs about [\d,]+ bytes .* has [\d,]+ bytes .* free"):
        ShardWriter(
            tmp_path / "t-00000.safetensors",
            sample_ids=["a" * 64],
            lengths=[tokens],
            hidden_size=H,
            store_dtype="float32",
        )
    assert list(tmp_path.iterdir()) == []
    assert estimate_shard_bytes([tokens], H, 3, "float32") > free


WRITER = """
import sys, time, torch
from pathlib import Path
from eagle3_core.store.shards import ShardWriter
lengths = [50] * 8
with ShardWriter(Path(sys.argv[1]), sample_ids=[f"{i:064x}" for i in range(8)], lengths=lengths, hidden_size=16, store_dtype="float32") as w:
    for i in range(4):
        w.write_sample(i, torch.zeros(50, dtype=torch.int32), torch.ones(50, dtype=torch.uint8), torch.randn(50, 48), torch.randn(50, 16))
    print("half", flush=True)
    time.sleep(60)
"""


def test_sigkill_mid_shard_leaves_no_visible_shard_and_the_next_run_writes_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "half"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not path.exists() and not path.with_suffix(".json").exists()
    temps = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(temps) == 1
    assert not verify_shard(temps[0]).ok
    assert store_stats(tmp_path).shards == []
    _write(path, [50] * 8)  # the next writer removes the stale temporary and writes the shard whole
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["t-00000.json", "t-00000.safetensors"]
    assert verify_shard(path).ok


def test_verify_reads_the_rows_of_failed_samples_too(tmp_path: Path) -> None:
    """The vocabulary counts a failed sample's (zero) tokens, so a flipped byte there is damage as well."""
    path = tmp_path / "t-00000.safetensors"
    ids = [f"{i:064x}" for i in range(2)]
    with ShardWriter(path, sample_ids=ids, lengths=[4, 5], hidden_size=H, store_dtype="float32") as w:
        w.write_sample(0, *_samples([4])[0])
        w.mark_failed(1, "test")
        w.finalize()
    assert verify_shard(path).ok
    with ShardReader(path) as r:
        entry = r.header["input_ids"]
        position = r._data_start + entry["data_offsets"][0] + 4 * 4 + 1  # sample 1's first input id
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x01
    path.write_bytes(bytes(raw))
    result = verify_shard(path)
    assert result.problems == [f"{path}: failed sample ({ids[1][:12]}) fails its checksum"]
