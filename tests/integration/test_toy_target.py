"""The toy target end to end: a few training steps, a standard HF directory, determinism, the cache."""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from eagle3_core.toy import build
from eagle3_core.toy.build import REPORT_FILE, ToyTargetReport, ensure_toy_target

pytestmark = pytest.mark.slow

STEPS = 12  # enough optimizer steps for reduction-order differences to reach the weights

BUILD_IN_A_PROCESS = """
import sys
from pathlib import Path
from eagle3_core.toy.build import build_toy_target, ensure_toy_target
how, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
if how == "build":
    print(build_toy_target(out, "xs", seed=0, steps=steps, log=lambda _: None).model_dump_json())
else:
    print(ensure_toy_target(out, "xs", seed=0, steps=steps, log=lambda _: None))
"""


def _in_a_fresh_process(how: str, out: Path, threads: dict[str, str]) -> str:
    """build_toy_target (`how` "build", printing its report) or ensure_toy_target ("ensure", printing the
    target's directory) in a fresh process, as a fresh clone would run it; its stdout's last line."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | threads
    result = subprocess.run(
        [sys.executable, "-c", BUILD_IN_A_PROCESS, how, str(out), str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ToyTargetReport]:
    """A build in a fresh process with one OpenMP thread: its directory and the report it returned."""
    out = tmp_path_factory.mktemp("toy") / "target"
    printed = _in_a_fresh_process("build", out, {"OMP_NUM_THREADS": "1"})
    return out, ToyTargetReport.model_validate_json(printed)


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """ensure_toy_target into an empty cache, in a fresh process with the default thread setting."""
    root = tmp_path_factory.mktemp("cache")
    return root, Path(_in_a_fresh_process("ensure", root, {}))


def test_report(built: tuple[Path, ToyTargetReport]) -> None:
    out, report = built
    on_disk = json.loads((out / REPORT_FILE).read_text())
    assert ToyTargetReport(**on_disk) == report
    assert (report.size, report.seed, report.steps) == ("xs", 0, STEPS)
    assert report.train_tokens == STEPS * 4 * 512
    assert 2_000_000 < report.params < 4_000_000
    assert report.vocab_size == 4096
    assert report.train_conversations > 3000 and 0 < report.heldout_conversations < 200
    # Twelve steps barely move a randomly initialised model: the loss is still high (ln(vocab) is 8.3).
    assert math.isfinite(report.heldout_loss) and 5.0 < report.heldout_loss < 10.0
    assert report.heldout_tokens > 10_000
    assert len(report.fingerprint) == 64


def test_same_seed_gives_identical_weights(
    built: tuple[Path, ToyTargetReport], cached: tuple[Path, Path]
) -> None:
    (out, report), (_, cached_dir) = built, cached
    a, b = load_file(out / "model.safetensors"), load_file(cached_dir / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "tokenizer.json").read_bytes() == (cached_dir / "tokenizer.json").read_bytes()
    assert json.loads((cached_dir / REPORT_FILE).read_text())["fingerprint"] == report.fingerprint


def test_builds_in_fresh_processes_are_bit_identical_whatever_the_thread_setting(
    built: tuple[Path, ToyTargetReport], cached: tuple[Path, Path]
) -> None:
    """Two processes, as two fresh clones would run it: one with one OpenMP thread (`built`), one with the
    default (`cached`). The build pins its own thread count, so every file it writes is byte for byte the same."""
    outs = [built[0], cached[1]]
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    for name in names:
        if name != REPORT_FILE:
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    reports = [json.loads((out / REPORT_FILE).read_text()) for out in outs]
    for report in reports:
        del report["build_seconds"]
    assert reports[0] == reports[1]


def test_loads_offline_and_generates_until_end_of_turn(built: tuple[Path, ToyTargetReport]) -> None:
    out, _ = built
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    assert model.config.num_hidden_layers == 8 and not model.config.tie_word_embeddings
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert tok.eos_token_id == eot
    gen_config = GenerationConfig.from_pretrained(out)
    assert eot in gen_config.eos_token_id

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi how are you?"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    assert prompt[0, 0].item() == tok.bos_token_id
    max_new = 12
    out_ids = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new, do_sample=False
    )
    new = out_ids[0, prompt.shape[1] :].tolist()
    assert 0 < len(new) <= max_new
    stops = set(gen_config.eos_token_id)
    # Generation ends at the first stop token, or runs to max_new_tokens without meeting one.
    assert (new[-1] in stops and not stops & set(new[:-1])) or (len(new) == max_new and not stops & set(new))


def test_hidden_states_cover_every_layer(built: tuple[Path, ToyTargetReport]) -> None:
    model = AutoModelForCausalLM.from_pretrained(built[0])
    out = model(input_ids=torch.tensor([[0, 3, 100, 200]]), output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert out.hidden_states[0].shape == (1, 4, 128)


def test_ensure_builds_once(cached: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root, first = cached
    assert first.name.startswith("toy-xs-") and first.parent == root
    assert sorted(p.name for p in root.iterdir()) == [first.name]  # no temporary left behind
    mtime = (first / REPORT_FILE).stat().st_mtime_ns

    def no_build(*args: object, **kwargs: object) -> ToyTargetReport:
        raise AssertionError("ensure_toy_target rebuilt a cached target")

    monkeypatch.setattr(build, "build_toy_target", no_build)
    started = time.monotonic()
    assert ensure_toy_target(root, "xs", seed=0, log=lambda _: None, steps=STEPS) == first
    assert time.monotonic() - started < 1.0
    assert (first / REPORT_FILE).stat().st_mtime_ns == mtime
    # Another seed is another target: the key covers it, so this call would build (and here fails).
    with pytest.raises(AssertionError, match="rebuilt"):
        ensure_toy_target(root, "xs", seed=1, log=lambda _: None, steps=STEPS)
    assert sorted(p.name for p in root.iterdir()) == [first.name]


def test_crashed_build_leaves_no_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(out_dir: Path, *args: object, **kwargs: object) -> ToyTargetReport:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(build, "build_toy_target", crash)
    with pytest.raises(RuntimeError, match="mid-build"):
        ensure_toy_target(tmp_path, "xs", seed=0, log=lambda _: None, steps=STEPS)
    assert list(tmp_path.iterdir()) == []


def test_a_second_build_waits_for_the_first_and_reuses_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process holds the cache (an flock on the directory itself), ensure_toy_target waits,
    then finds the target built and builds nothing; no lock file is left in the cache."""
    builds: list[Path] = []

    def fake_build(out_dir: Path, *args: object, **kwargs: object) -> None:
        builds.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(build, "build_toy_target", fake_build)
    said: list[str] = []
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other builder
    waiter = threading.Thread(
        target=lambda: ensure_toy_target(tmp_path, "xs", seed=0, log=said.append, steps=STEPS)
    )
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not builds
    assert any("waiting for it" in line for line in said), said
    # the other builder finishes: its target is in place when it lets go
    final = tmp_path / f"toy-xs-{build.cache_key(build.get_preset('xs'), 0, STEPS)}"
    final.mkdir()
    os.close(fd)
    waiter.join(timeout=30)
    assert not waiter.is_alive() and not builds
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_packing_cuts_the_concatenated_stream() -> None:
    pieces = [torch.arange(n, dtype=torch.int32) + 100 * n for n in [5, 3, 9, 1, 7, 2, 8, 4, 6] * 4]
    batches = build._packed_batches(iter(pieces), batch_size=2, seq_len=4)
    got = torch.cat([next(batches).flatten() for _ in range(20)])
    assert torch.equal(got, torch.cat(pieces)[:160].long())


def test_token_stream_reshuffles_every_epoch(tmp_path: Path) -> None:
    conversations, _ = build._chitchat_conversations()
    few = conversations[:6]
    tok = build.train_tokenizer(build._tokenizer_texts(few), 300)
    stream = build._token_stream(tok, few, torch.Generator().manual_seed(0))
    epochs = [[tuple(next(stream).tolist()) for _ in few] for _ in range(3)]
    expected = sorted(tuple(ids) for ids in build._encode(tok, few))
    assert all(sorted(epoch) == expected for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1  # 720 orders of six: three equal ones would be a bug


def test_cache_key_covers_what_shapes_the_target() -> None:
    xs = build.get_preset("xs")
    keys = {
        build.cache_key(xs, 0),
        build.cache_key(xs, 1),
        build.cache_key(xs, 0, steps=2),
        build.cache_key(build.get_preset("m"), 0),
        build.cache_key(xs.model_copy(update={"lr": 1e-3}), 0),
    }
    assert len(keys) == 5
    assert build.cache_key(xs, 0) == build.cache_key(xs, 0, steps=xs.steps)


KEY_IN_A_PROCESS = """
from eagle3_core.toy import build
print(build.kernel_set(), build.cache_key(build.get_preset("xs"), 0))
"""


def test_cache_key_covers_the_cpu_kernel_set() -> None:
    """A toy built under ATen's default kernels is another toy (its weights and replies differ), so it is
    cached apart from the native build instead of being mistaken for it."""
    printed = {}
    for capability in ("", "default"):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env |= {"ATEN_CPU_CAPABILITY": capability} if capability else {}
        result = subprocess.run(
            [sys.executable, "-c", KEY_IN_A_PROCESS], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr[-3000:]
        printed[capability] = result.stdout.split()
    if printed[""][0].endswith("-DEFAULT"):
        pytest.skip("this CPU has no vector kernels: ATEN_CPU_CAPABILITY=default is its native set")
    assert printed["default"][0].endswith("-DEFAULT") and printed[""][0] != printed["default"][0]
    assert printed[""][1] != printed["default"][1]
