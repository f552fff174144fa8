"""In-process regeneration on a real (tiny, random) transformers target."""

import json
import re
import signal
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, GemmaConfig, GemmaForCausalLM

from eagle3_core.config import Eagle3Config, RegenerateConfig, load_config
from eagle3_core.data.ingest import ingest, load_conversation_shard
from eagle3_core.data.tokenize import generation_prompt_ids
from eagle3_core.errors import ConfigError
from eagle3_core.steps.data import extract_step, regenerate_step
from eagle3_core.store.atomic import read_jsonl
from eagle3_core.store.checks import shard_complete
from eagle3_core.store.journal import journal_path
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import conversation_id, reply_id
from eagle3_core.targets.hf import TransformersTarget, load_causal_lm
from eagle3_core.targets.regenerate import Regenerator, Reply, request_seed, step_of
from tests.conftest import write_config
from tests.helpers import (
    SCRIPTED_REPLY,
    TINY_TARGET_SIZES,
    save_scripted_chat_target,
    save_tiny_chat_target,
)
from tests.kill import eagle3_on_one_thread, run_killed_at_call, run_killed_at_nth_call

# tiny models, generating a few tokens: a second OpenMP thread only waits (tests/conftest.py one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TransformersTarget]:
    root = tmp_path_factory.mktemp("regen")
    target_dir = save_tiny_chat_target(root / "target")
    with open(root / "c.jsonl", "w") as f:
        for i in range(10):
            turns = [
                {"role": "user", "content": f"hello number {i}"},
                {"role": "assistant", "content": "original reply"},
            ]
            turns += [{"role": "user", "content": "tell me more"}] * (i % 2)  # odd rows end with a user turn
            f.write(json.dumps({"messages": turns}) + "\n")
    config = write_config(
        root,
        f"store: store\ndata: {{dataset: r, holdout_fraction: 0.2, sources: [{{path: c.jsonl}}]}}\n"
        f"target: {{path: {target_dir}}}\nregenerate: {{max_new_tokens: 5, batch_size: 3}}\n",
    )
    cfg = load_config(config)
    ingest(cfg)
    return config, TransformersTarget(target_dir, cfg.target)


def test_every_assistant_turn_is_the_targets_and_ids_are_kept(setup: tuple[Path, TransformersTarget]) -> None:
    config, target = setup
    cfg = load_config(config)
    samples, _ = load_conversation_shard(cfg.store_root, "r-00000")
    train = [s for s in samples if s.split == "train"]
    result = regenerate_step(cfg, "r-00000", target)
    rows = read_jsonl(result.path)
    assert [r["id"] for r in rows] == [s.id for s in train]  # keyed by sample id: none skipped, none doubled
    assert result.metadata["heldout_skipped"] == len(samples) - len(train)
    for row, original in zip(rows, train, strict=True):
        if "error" in row:
            continue
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert users == [m.content for m in original.messages if m.role == "user"][: len(users)]
        assistants = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert "original reply" not in assistants
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * len(users)
    # a prompt that ended with a user turn got its answer too
    assert any(r.get("turns_regenerated") == 2 for r in rows)


def test_greedy_regeneration_is_deterministic_and_atomic(setup: tuple[Path, TransformersTarget]) -> None:
    config, target = setup
    cfg = load_config(config)
    path = StoreLayout(cfg.store_root).regenerated("r-00000")
    first = regenerate_step(cfg, "r-00000", target).path.read_bytes()
    assert regenerate_step(cfg, "r-00000", target).path.read_bytes() == first
    assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_regenerated_shard_is_whole_with_its_manifest_or_absent(
    setup: tuple[Path, TransformersTarget], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while a redo writes the shard: neither the old shard beside the new manifest nor a
    half-written file is left, and the next run completes it."""
    import errno

    from eagle3_core.steps import data

    config, target = setup
    cfg = load_config(config)
    layout = StoreLayout(cfg.store_root)
    regenerate_step(cfg, "r-00000", target)
    reference = layout.regenerated("r-00000").read_bytes()

    def disk_full(path: Path, rows: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(data, "write_rows", disk_full)
    with pytest.raises(OSError, match="No space left"):
        regenerate_step(cfg, "r-00000", target)
    assert not layout.regenerated("r-00000").exists()  # not done: the next run redoes it
    assert [p.name for p in layout.regenerated("r-00000").parent.iterdir() if ".tmp-" in p.name] == []
    monkeypatch.undo()
    regenerate_step(cfg, "r-00000", target)
    assert layout.regenerated("r-00000").read_bytes() == reference
    assert json.loads(layout.regenerated_manifest("r-00000").read_text())["key"] == "r-00000"


# ---- a scripted target (its reply is known on any CPU): progress, kills, batches ---------------------------
SHORT = [f"hello number {i}" for i in range(6)]
MEDIUM = ["tell me about " + "the hills and the dog " * 6, "what is yours? " + "the weather is nice " * 7]
LONG = "i went hiking with my dog in the hills " * 40  # an opening turn far longer than the others
SCRIPTED_KEY = "s-00000"


def _scripted_rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i, user in enumerate([*SHORT, *MEDIUM, LONG]):
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": "original reply"}]
        turns += [{"role": "user", "content": "tell me more"}] * (i % 2)  # odd rows: a second turn
        rows.append({"messages": turns})
    return rows


def _scripted_store(
    root: Path, target_dir: Path, regenerate: str = "max_new_tokens: 12, batch_size: 3"
) -> Path:
    """A config (and its ingested store) of the conversations above, all of them training conversations."""
    root.mkdir(parents=True, exist_ok=True)
    source = root.parent / "scripted.jsonl"
    if (
        not source.exists()
    ):  # one source file for every store: rows of two stores are byte for byte comparable
        source.write_text("".join(json.dumps(row) + "\n" for row in _scripted_rows()))
    config = write_config(
        root,
        f"store: store\ndata: {{dataset: s, holdout_fraction: 0.0, sources: [{{path: {source}}}]}}\n"
        f"target: {{path: {target_dir}, device: cpu}}\nregenerate: {{{regenerate}}}\n",
    )
    ingest(load_config(config))
    return config


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scripted_chat_target(tmp_path_factory.mktemp("scripted") / "target")


class BatchSpy:
    """Wraps Regenerator.generate_batch: the prompt lengths (and the seeds) of every batch it was given, in call
    order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[list[int]] = []
        self.seeds: list[list[int]] = []
        real = Regenerator.generate_batch

        def spied(
            regenerator: Regenerator, prompts: list[list[int]], seeds: Sequence[int] | None = None
        ) -> list[Reply]:
            self.batches.append([len(p) for p in prompts])
            self.seeds.append(list(seeds or []))
            return real(regenerator, prompts, seeds)

        monkeypatch.setattr(Regenerator, "generate_batch", spied)


PROGRESS = re.compile(
    rf"^{SCRIPTED_KEY}: (\d+)/(\d+) samples regenerated; (\d+) new tokens, [\d.]+ tokens/s, ETA (\S+)$"
)


def test_regeneration_logs_samples_tokens_rate_and_eta_after_every_batch(
    scripted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(_scripted_store(tmp_path / "p", scripted))
    spy = BatchSpy(monkeypatch)
    logged: list[str] = []
    target = TransformersTarget(scripted, cfg.target)
    result = regenerate_step(cfg, SCRIPTED_KEY, target, logged.append)
    lines = [m for m in logged if "samples regenerated" in m]
    assert len(lines) == len(spy.batches) > 1  # one line per batch
    parsed = [PROGRESS.match(line) for line in lines]
    assert all(parsed), lines
    done = [int(m[1]) for m in parsed if m]
    tokens = [int(m[3]) for m in parsed if m]
    assert done == sorted(done) and tokens == sorted(tokens) and 0 < done[0] < done[-1]
    assert {int(m[2]) for m in parsed if m} == {len(_scripted_rows())}
    assert done[-1] == len(_scripted_rows()) and tokens[-1] == result.metadata["new_tokens"] > 0
    assert parsed[-1] is not None and parsed[-1][4] == "0s"  # nothing left


def test_regeneration_batches_prompts_of_one_length_and_gives_what_unbatched_generation_gives(
    scripted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is left-padded to its longest prompt: the long opening turn is batched alone, not with short
    prompts padded to its length; the rows are those of one prompt at a time (float32), in input order."""
    unbatched = load_config(_scripted_store(tmp_path / "one", scripted, "max_new_tokens: 12, batch_size: 1"))
    batched = load_config(_scripted_store(tmp_path / "four", scripted, "max_new_tokens: 12, batch_size: 4"))
    target = TransformersTarget(scripted, batched.target)
    assert target.info.dtype == "float32"
    spy = BatchSpy(monkeypatch)
    rows = regenerate_step(batched, SCRIPTED_KEY, target).path.read_bytes()
    assert max(len(b) for b in spy.batches) == 4  # batched, up to batch_size
    for lengths in spy.batches:
        assert max(lengths) <= 2 * min(lengths), spy.batches  # no batch pads a prompt to twice its length
    longest = max(max(b) for b in spy.batches)
    assert [longest] in spy.batches  # the outlier alone
    spy.batches.clear()
    assert regenerate_step(unbatched, SCRIPTED_KEY, target).path.read_bytes() == rows
    assert all(len(b) == 1 for b in spy.batches)
    samples, _ = load_conversation_shard(batched.store_root, SCRIPTED_KEY)
    assert [json.loads(line)["id"] for line in rows.splitlines()] == [s.id for s in samples]


def test_a_regenerate_killed_after_some_batches_keeps_them_and_a_rerun_does_only_the_rest(
    scripted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eagle3 regenerate` SIGKILLed in place of its third batch: the samples the first two finished are in
    the shard's journal; the next `eagle3 regenerate` takes them from it, generates only the others, and
    writes exactly the rows of an uninterrupted run."""
    reference_cfg = load_config(_scripted_store(tmp_path / "reference", scripted))
    target = TransformersTarget(scripted, reference_cfg.target)
    reference = regenerate_step(reference_cfg, SCRIPTED_KEY, target).path.read_bytes()

    config = _scripted_store(tmp_path / "killed", scripted)
    shard = StoreLayout(load_config(config).store_root).regenerated(SCRIPTED_KEY)
    code = run_killed_at_nth_call(
        "eagle3_core.targets.regenerate:Regenerator.generate_batch",
        3,
        eagle3_on_one_thread,
        "--config",
        str(config),
        "regenerate",
    )
    assert code == -signal.SIGKILL
    assert not shard.exists()  # nothing committed
    journaled = [json.loads(line)["id"] for line in journal_path(shard).read_text().splitlines()[1:]]
    total = len(_scripted_rows())
    assert 0 < len(journaled) < total and len(set(journaled)) == len(journaled)

    from eagle3_cli.main import main  # the rerun: `eagle3 regenerate` again, in this process

    assert main(["--config", str(config), "regenerate"]) == 0
    out = capsys.readouterr().out
    assert f"resumed_samples={len(journaled)}" in out
    first = PROGRESS.match(next(line for line in out.splitlines() if "samples regenerated" in line))
    assert first is not None and int(first[1]) > len(journaled)  # counted on from the journaled ones
    assert shard.read_bytes() == reference  # each sample once, in input order, as if never killed
    assert not journal_path(shard).exists()


def _masked_ends(cfg: Eagle3Config, eot: int) -> tuple[int, int, int]:
    """Over the extracted shard: the assistant turns (runs of loss), how many of them end on end-of-turn, and
    how many are followed by an untrained end-of-turn."""
    from eagle3_core.store.shards import ShardReader

    runs = on_eot = before_eot = 0
    with closing(ShardReader(StoreLayout(cfg.store_root).hidden_states(SCRIPTED_KEY))) as shard:
        for i in range(len(shard)):
            s = shard.sample(i)
            ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
            ends = [t for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]
            runs += len(ends)
            on_eot += sum(ids[t] == eot for t in ends)
            before_eot += sum(t + 1 < len(ids) and ids[t + 1] == eot for t in ends)
    return runs, on_eot, before_eot


def test_a_reply_cut_at_max_new_tokens_is_marked_counted_and_not_trained_as_an_ending(
    scripted: Path, tmp_path: Path
) -> None:
    """The scripted reply is 4 tokens and end-of-turn; at max_new_tokens 2 it is cut. The cut reply is kept
    (its tokens are the target's), marked `length` in the row, counted at regeneration and extraction, and
    its closing end-of-turn carries no loss: the target never ended a reply there."""
    finished = load_config(_scripted_store(tmp_path / "finished", scripted))
    cut = load_config(_scripted_store(tmp_path / "cut", scripted, "max_new_tokens: 2, batch_size: 3"))
    target = TransformersTarget(scripted, cut.target)
    eot = int(target.tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    for cfg in (finished, cut):
        regenerate_step(cfg, SCRIPTED_KEY, target)
    full, short = (regenerate_step(c, SCRIPTED_KEY, target).metadata for c in (finished, cut))
    assert full["replies_cut_at_max_new_tokens"] == 0 and full["replies"] > 0
    assert short["replies_cut_at_max_new_tokens"] == short["replies"] == full["replies"]  # counted, all kept
    for cfg, reason in ((finished, "stop"), (cut, "length")):
        rows = read_jsonl(StoreLayout(cfg.store_root).regenerated(SCRIPTED_KEY))
        assert all(r["finish_reasons"] == [reason] * r["turns_regenerated"] for r in rows)
    replies = [
        m for r in read_jsonl(StoreLayout(cut.store_root).regenerated(SCRIPTED_KEY)) for m in r["messages"]
    ]
    [kept] = {m["content"] for m in replies if m["role"] == "assistant"}
    assert SCRIPTED_REPLY.startswith(kept) and kept != SCRIPTED_REPLY  # the target's first tokens, kept

    extracted = {
        name: extract_step(cfg, SCRIPTED_KEY, target) for name, cfg in (("full", finished), ("cut", cut))
    }
    assert extracted["cut"].metadata["cut_replies"] == short["replies"]
    assert extracted["full"].metadata["cut_replies"] == 0
    assert _masked_ends(finished, eot) == (full["replies"], full["replies"], 0)  # trained through end-of-turn
    # a cut reply is trained up to its last token and no further: its end-of-turn follows, untrained
    assert _masked_ends(cut, eot) == (short["replies"], 0, short["replies"])


# ---- several replies per conversation (regenerate.samples) ----------------------------------------------
SAMPLED = "max_new_tokens: 12, batch_size: 3, temperature: 1.0"


def test_several_replies_are_rows_of_their_own_seeded_apart_and_extract_to_as_many_samples(
    scripted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """samples: 2 gives each training conversation two rows, reply 0 under the conversation's id and reply 1
    under `<id>~1`, each turn of each reply generated with its own seed; extraction takes them as twice the
    samples, with distinct ids, and the shard's completeness check counts both replies of each."""
    one = load_config(_scripted_store(tmp_path / "one", scripted, SAMPLED))
    two = load_config(_scripted_store(tmp_path / "two", scripted, f"{SAMPLED}, samples: 2"))
    target = TransformersTarget(scripted, two.target)
    train, _ = load_conversation_shard(two.store_root, SCRIPTED_KEY)
    spy = BatchSpy(monkeypatch)
    result = regenerate_step(two, SCRIPTED_KEY, target)
    expected = [reply_id(s.id, r) for s in train for r in range(2)]
    assert [r["id"] for r in read_jsonl(result.path)] == expected  # by conversation, then reply
    m = result.metadata
    assert m["replies_per_conversation"] == 2 and m["samples"] + m["errors"] == 2 * len(train)
    manifest = json.loads(StoreLayout(two.store_root).regenerated_manifest(SCRIPTED_KEY).read_text())
    assert manifest["replies_per_conversation"] == 2 and manifest["samples"] == m["samples"]
    seeds = [seed for batch in spy.seeds for seed in batch]
    assert len(seeds) == sum(len(b) for b in spy.batches) and len(set(seeds)) == len(seeds)  # one per request
    assert {request_seed(0, i, 0) for i in expected} <= set(seeds)  # every reply's first turn, its own seed
    assert regenerate_step(two, SCRIPTED_KEY, target).path.read_bytes() == result.path.read_bytes()
    assert regenerate_step(one, SCRIPTED_KEY, target).metadata["replies_per_conversation"] == 1

    single, double = (extract_step(cfg, SCRIPTED_KEY, target).metadata for cfg in (one, two))
    counted = ("samples", "failed", "dropped", "regeneration_errors")
    assert sum(double[k] for k in counted) == 2 * sum(single[k] for k in counted) == 2 * len(train)
    assert double["samples"] == 2 * single["samples"] > 0
    from eagle3_core.store.shards import ShardReader

    with closing(ShardReader(StoreLayout(two.store_root).hidden_states(SCRIPTED_KEY))) as shard:
        ids = shard.sample_ids
    assert len(set(ids)) == len(ids) == double["samples"] and set(ids) <= set(expected)
    assert {conversation_id(i) for i in ids} == {s.id for s in train}
    verdict = shard_complete(two.store_root, SCRIPTED_KEY)
    assert verdict.passed, verdict.reason
    assert verdict.figures["replies_per_conversation"] == 2 and verdict.figures["accounted"] == 2 * len(train)


def test_same_seed_same_replies_on_a_target_whose_replies_vary(
    setup: tuple[Path, TransformersTarget],
) -> None:
    """The random target's replies at temperature 1 depend on every draw: a second run of the same settings
    samples the same rows, byte for byte (each row's draws come from its own seed, not torch's RNG)."""
    config, target = setup
    cfg = load_config(config)
    sampled = cfg.regenerate.model_copy(update={"samples": 3, "temperature": 1.0})
    cfg = cfg.model_copy(update={"regenerate": sampled})
    first = regenerate_step(cfg, "r-00000", target)
    rows = read_jsonl(first.path)
    train = [s for s in load_conversation_shard(cfg.store_root, "r-00000")[0] if s.split == "train"]
    assert [r["id"] for r in rows] == [reply_id(s.id, r) for s in train for r in range(3)]
    torch.manual_seed(12345)  # torch's RNG is not what samples
    assert regenerate_step(cfg, "r-00000", target).path.read_bytes() == first.path.read_bytes()


def test_a_regenerate_of_two_replies_killed_mid_shard_resumes_each_reply_once(
    scripted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eagle3 regenerate` at samples: 2 SIGKILLed in place of its third batch: the replies finished are in the
    journal under their own ids, the rerun generates only the others, and the shard is an uninterrupted run's,
    each reply once, by conversation then reply."""
    settings = f"{SAMPLED}, samples: 2"
    reference_cfg = load_config(_scripted_store(tmp_path / "reference", scripted, settings))
    target = TransformersTarget(scripted, reference_cfg.target)
    reference = regenerate_step(reference_cfg, SCRIPTED_KEY, target).path.read_bytes()

    config = _scripted_store(tmp_path / "killed", scripted, settings)
    shard = StoreLayout(load_config(config).store_root).regenerated(SCRIPTED_KEY)
    code = run_killed_at_nth_call(
        "eagle3_core.targets.regenerate:Regenerator.generate_batch",
        3,
        eagle3_on_one_thread,
        "--config",
        str(config),
        "regenerate",
    )
    assert code == -signal.SIGKILL
    assert not shard.exists()
    journaled = [json.loads(line)["id"] for line in journal_path(shard).read_text().splitlines()[1:]]
    total = 2 * len(_scripted_rows())
    assert 0 < len(journaled) < total and len(set(journaled)) == len(journaled)

    from eagle3_cli.main import main

    assert main(["--config", str(config), "regenerate"]) == 0
    out = capsys.readouterr().out
    assert f"resumed_samples={len(journaled)}" in out and "replies_per_conversation=2" in out
    progress = [PROGRESS.match(line) for line in out.splitlines() if "samples regenerated" in line]
    assert progress and all(p is not None and int(p[2]) == total for p in progress)  # counted in replies
    assert shard.read_bytes() == reference  # each reply once, in order, as if never killed
    ids = [json.loads(line)["id"] for line in shard.read_bytes().splitlines()]
    assert len(ids) == len(set(ids)) == total and set(journaled) <= set(ids)
    assert not journal_path(shard).exists()


def test_a_torn_journal_gives_every_intact_entry_and_only_the_rest_is_regenerated(
    scripted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal of 20 entries with a 21st torn by a kill mid-write, one entry written twice and a line of a
    sample not in the shard: the rerun takes all 20 (a duplicate's first line, the foreign line skipped),
    regenerates only the 21st, and writes the rows of an uninterrupted run, each once."""
    source = tmp_path / "journal.jsonl"
    source.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"hello number {i}"},
                                     {"role": "assistant", "content": "original reply"}]}) + "\n"
            for i in range(21)
        )
    )  # fmt: skip

    def store(root: Path) -> Path:
        config = write_config(
            root,
            f"store: store\ndata: {{dataset: j, holdout_fraction: 0.0, sources: [{{path: {source}}}]}}\n"
            f"target: {{path: {scripted}, device: cpu}}\nregenerate: {{max_new_tokens: 12, batch_size: 3}}\n",
        )
        ingest(load_config(config))
        return config

    reference_cfg = load_config(store(tmp_path / "reference"))
    target = TransformersTarget(scripted, reference_cfg.target)
    reference = regenerate_step(reference_cfg, "j-00000", target).path.read_bytes()

    config = store(tmp_path / "killed")
    shard = StoreLayout(load_config(config).store_root).regenerated("j-00000")
    # killed as it writes the shard: every sample journaled, none committed
    code = run_killed_at_call(
        "eagle3_core.steps.data:write_rows", eagle3_on_one_thread, "--config", str(config), "regenerate"
    )
    assert code == -signal.SIGKILL and not shard.exists()
    header, *entries = journal_path(shard).read_bytes().splitlines(keepends=True)
    assert len(entries) == 21
    foreign = json.loads(entries[0])
    foreign["id"] = foreign["row"]["id"] = "f" * 64  # another shard's sample
    foreign_line = json.dumps(foreign).encode() + b"\n"
    kept, last = entries[:20], entries[20]
    doctored = [header, *kept[:10], kept[3], foreign_line, *kept[10:], last[: len(last) // 2]]
    journal_path(shard).write_bytes(b"".join(doctored))

    spy = BatchSpy(monkeypatch)
    from eagle3_cli.main import main

    capsys.readouterr()
    assert main(["--config", str(config), "regenerate"]) == 0
    out = capsys.readouterr().out
    assert "resumed_samples=20" in out
    assert sum(len(b) for b in spy.batches) == 1  # the torn 21st alone
    assert shard.read_bytes() == reference  # each sample once, in input order, as if never killed
    assert not journal_path(shard).exists()


# ---- the batched target step (regenerate.step: batched): generate's replies, token for token -----------------
STEP_MAX_NEW_TOKENS = 10


def _toy(toy_target_dir: Path) -> tuple[Any, Any, list[list[int]]]:
    """The toy target in float32 on the CPU, its tokenizer, and prompts of six lengths: two chat prompts and
    four of random tokens (the toy's greedy replies to chat prompts are much alike)."""
    tokenizer = AutoTokenizer.from_pretrained(toy_target_dir)
    model = load_causal_lm(toy_target_dir, torch.device("cpu"), torch.float32)
    chats = ["hi", "what do you like to eat on a cold winter evening after a long day at work?"]
    prompts = [generation_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in chats]
    generator = torch.Generator().manual_seed(1)
    prompts += [torch.randint(5, len(tokenizer), (n,), generator=generator).tolist() for n in (3, 17, 7, 23)]
    assert len({len(p) for p in prompts}) == len(prompts)
    return model, tokenizer, prompts


def _step_ids(
    model: Any,
    tokenizer: Any,
    step: str,
    prompts: list[list[int]],
    seeds: list[int] | None = None,
    **settings: Any,
) -> tuple[list[list[int]], list[int]]:
    """generate_ids with `regenerate.step` `step` (the batched step never calling `generate`), and the eos ids."""
    cfg = RegenerateConfig(max_new_tokens=STEP_MAX_NEW_TOKENS, batch_size=8, step=step, **settings)  # type: ignore[arg-type]
    regenerator = Regenerator(model, tokenizer, cfg, max_seq_len=512)
    assert regenerator.step == step

    def no_generate(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the batched step called generate")

    with pytest.MonkeyPatch.context() as patch:
        if step == "batched":
            patch.setattr(model, "generate", no_generate)
        return regenerator.generate_ids(prompts, seeds), regenerator.eos_ids


def _reply(row: list[int], eos_ids: list[int]) -> list[int]:
    return row[: next((i for i, t in enumerate(row) if t in eos_ids), len(row))]


def _make_an_eos(model: Any, rows: list[list[int]], eos_ids: list[int]) -> int:
    """Add to the target's eos ids a token that one row's reply reaches early and some reply cut at
    max_new_tokens never reaches: then that row (returned) ends early and some are cut, whatever the toy says."""
    replies = [_reply(row, eos_ids) for row in rows]
    cut = [r for r in replies if len(r) == STEP_MAX_NEW_TOKENS]
    row, eos = next((i, t) for i, r in enumerate(replies) for t in r[1:4] if any(t not in c for c in cut))
    model.generation_config.eos_token_id = [*eos_ids, eos]
    return row


@pytest.mark.parametrize(
    "settings",
    [{}, {"temperature": 0.9}, {"temperature": 0.9, "top_p": 0.9}],
    ids=["greedy", "sampled", "sampled_top_p"],
)
def test_the_batched_step_replies_what_generate_does_token_for_token(
    toy_target_dir: Path, settings: dict[str, float]
) -> None:
    """The toy in float32, prompts of different lengths, greedy or sampled with each row's own seed: the
    batched step (each row prefilled alone, no padding) gives generate's ids, an eos then padding where a row
    ended early, and rows cut at max_new_tokens alike."""
    model, tokenizer, prompts = _toy(toy_target_dir)
    seeds = [request_seed(3, f"sample-{i}", 0) for i in range(len(prompts))]
    free, eos_ids = _step_ids(model, tokenizer, "generate", prompts, seeds, **settings)
    ends = _make_an_eos(model, free, eos_ids)
    generated, eos_ids = _step_ids(model, tokenizer, "generate", prompts, seeds, **settings)
    batched, _ = _step_ids(model, tokenizer, "batched", prompts, seeds, **settings)
    assert batched == generated
    lengths = [len(_reply(row, eos_ids)) for row in batched]
    assert lengths[ends] < STEP_MAX_NEW_TOKENS and STEP_MAX_NEW_TOKENS in lengths  # ended early; cut
    assert {len(row) for row in batched} == {STEP_MAX_NEW_TOKENS}  # padded to the longest, as generate pads


def test_a_shard_regenerated_with_the_batched_step_is_generates(toy_target_dir: Path, tmp_path: Path) -> None:
    """`regenerate_step` on the toy, greedy in float32: step batched writes generate's shard and counts, and
    the step taken is logged and in the manifest."""
    configs = {
        step: load_config(
            _scripted_store(
                tmp_path / step, toy_target_dir, f"max_new_tokens: 12, batch_size: 3, step: {step}"
            )
        )
        for step in ("generate", "batched")
    }
    target = TransformersTarget(toy_target_dir, configs["batched"].target)
    assert target.info.dtype == "float32"
    logged: list[str] = []
    results = {
        step: regenerate_step(cfg, SCRIPTED_KEY, target, logged.append) for step, cfg in configs.items()
    }
    assert results["batched"].path.read_bytes() == results["generate"].path.read_bytes()
    timed = {"seconds", "tokens_per_second", "step"}
    generate, batched = ({k: v for k, v in r.metadata.items() if k not in timed} for r in results.values())
    assert batched == generate and generate["replies"] > 0
    assert [r.metadata["step"] for r in results.values()] == ["generate", "batched"]
    manifest = StoreLayout(configs["batched"].store_root).regenerated_manifest(SCRIPTED_KEY)
    assert json.loads(manifest.read_text())["step"] == "batched"
    assert "decoding with batched (regenerate.step batched)" in logged


def test_the_batched_step_refuses_a_target_it_does_not_compute_in_one_line(toy_target_dir: Path) -> None:
    """step batched: a family the step does not compute, or a generation config whose logits processor
    generate would apply, is refused in one line naming regenerate.step; auto takes generate there, and on a
    CPU whatever the target."""
    tokenizer = AutoTokenizer.from_pretrained(toy_target_dir)
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**TINY_TARGET_SIZES, head_dim=8)).eval()
    with pytest.raises(ConfigError) as refused:
        Regenerator(gemma, tokenizer, RegenerateConfig(step="batched"), max_seq_len=512)
    message = str(refused.value)
    assert re.fullmatch(
        r"regenerate\.step: batched: GemmaForCausalLM: model_type 'gemma' is not one of llama, .*; "
        r"set step: generate \(or auto\)",
        message,
    ), message
    step, why = step_of("auto", gemma, on_gpu=True)
    assert step == "generate" and "model_type 'gemma'" in why
    toy = load_causal_lm(toy_target_dir, torch.device("cpu"), torch.float32)
    assert step_of("auto", toy, on_gpu=True)[0] == "batched"
    assert step_of("auto", toy, on_gpu=False) == (
        "generate",
        "regenerate.step auto: the batched step only on a GPU",
    )
    assert Regenerator(toy, tokenizer, RegenerateConfig(step="auto"), max_seq_len=512).step == "generate"
    toy.generation_config.repetition_penalty = 1.1  # generate would penalise repeated tokens, the step not
    with pytest.raises(ConfigError, match=r"^regenerate\.step: batched: .*sets repetition_penalty, [^\n]*$"):
        step_of("batched", toy, on_gpu=False)
    assert step_of("auto", toy, on_gpu=True)[0] == "generate"
