"""In-process regeneration on a real (tiny, random) transformers target."""

import json
import re
import signal
from contextlib import closing
from pathlib import Path

import pytest

from eagle3_core.config import Eagle3Config, load_config
from eagle3_core.data.ingest import ingest, load_conversation_shard
from eagle3_core.steps.data import extract_step, regenerate_step
from eagle3_core.store.atomic import read_jsonl
from eagle3_core.store.journal import journal_path
from eagle3_core.store.layout import StoreLayout
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.regenerate import Regenerator, Reply
from tests.conftest import write_config
from tests.helpers import SCRIPTED_REPLY, save_scripted_chat_target, save_tiny_chat_target
from tests.kill import eagle3_on_one_thread, run_killed_at_nth_call

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
    """Wraps Regenerator.generate_batch: the prompt lengths of every batch it was given, in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[list[int]] = []
        real = Regenerator.generate_batch

        def spied(regenerator: Regenerator, prompts: list[list[int]]) -> list[Reply]:
            self.batches.append([len(p) for p in prompts])
            return real(regenerator, prompts)

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
