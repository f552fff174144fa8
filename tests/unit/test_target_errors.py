"""A target directory eagle3 cannot load is refused through the CLI as one line naming the file or field,
exit 2, before any weight is read: copies of the toy target, each broken one way."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from eagle3_cli.main import main
from eagle3_core.config import TargetConfig
from eagle3_core.errors import TargetError
from eagle3_core.targets.resolve import check_target_dir, safetensors_weights
from tests.conftest import write_config
from tests.exports import write_tiny_export
from tests.records import write_summary

Break = Callable[[Path], None]
DATA = "data: {dataset: cc, shard_size: 12, sources: [{kind: chitchat, limit: 12}]}\n"
BROKEN_TEMPLATE = "{% for m in messages %}\n{{ m['content'] }}\n{% if m.role == 'user' %}\n{% endfor %}\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ingested store for every test (the commands fail before they write to it), with a fake finished
    and exported drafter so that `eval` and `export` get as far as loading the target."""
    root = tmp_path_factory.mktemp("store-project")
    config = write_config(root, f"store: store\n{DATA}")
    assert main(["--config", str(config), "ingest"]) == 0
    store = root / "store"
    final = store / "drafter" / "runs" / "fake" / "final"
    write_summary(final, "fake")
    (store / "drafter" / "latest.json").write_text(json.dumps({"run": "fake", "final": str(final)}))
    write_tiny_export(store / "drafter" / "export" / "fake")  # complete: eval refuses half an export
    return store


@pytest.fixture(autouse=True)
def _no_model_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that came after loading the weights would come too late: loading is a test failure here."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the target's weights were loaded before the directory was checked")

    monkeypatch.setattr("eagle3_core.targets.hf.load_causal_lm", refuse)


def _broken_copy(toy_target_dir: Path, tmp_path: Path, breaks: Break) -> Path:
    target = tmp_path / "broken-target"
    shutil.copytree(toy_target_dir, target)
    breaks(target)
    return target


def _project(tmp_path: Path, store: Path, target: Path, extra: str = "", aux: str = "") -> Path:
    aux_ids = f", aux_layer_ids: {aux}" if aux else ""
    return write_config(
        tmp_path / "project",
        f"store: {store}\n{DATA}target: {{path: {target}, device: cpu{aux_ids}}}\n{extra}",
    )


def _one_error_line(rc: int, out: str) -> str:
    lines = out.strip().splitlines()
    assert rc == 2, out
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert "Traceback" not in out
    return lines[0]


def _edit_config(target: Path, **changes: object) -> None:
    path = target / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _pickled_weights_only(target: Path) -> None:
    for path in target.glob("*.safetensors"):
        path.unlink()
    (target / "pytorch_model.bin").write_bytes(b"never read: eagle3 does not unpickle")


def _no_weights(target: Path) -> None:
    for path in target.glob("*.safetensors"):
        path.unlink()


def _broken_jinja(target: Path) -> None:
    (target / "chat_template.jinja").write_text(BROKEN_TEMPLATE)


def _broken_template_in_tokenizer_config(target: Path) -> None:
    (target / "chat_template.jinja").unlink()
    path = target / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": BROKEN_TEMPLATE}))


def _not_json(target: Path) -> None:
    (target / "config.json").write_text('{"model_type": "llama",\n "num_hidden_layers": 8,,}')


def _nested_too_deeply(target: Path) -> None:
    depth = 100_000  # far past Python's recursion limit, which json's parser recurses against
    (target / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}")


def _tokenizer_config_only(target: Path, text: str) -> None:
    """tokenizer_config.json holds the chat template once chat_template.jinja, which transformers prefers,
    is gone; `text` replaces the file."""
    (target / "chat_template.jinja").unlink()
    (target / "tokenizer_config.json").write_text(text)


def _tokenizer_config_nested_too_deeply(target: Path) -> None:
    depth = 100_000
    _tokenizer_config_only(target, '{"chat_template": "x", "x": ' + "[" * depth + "]" * depth + "}")


def _tokenizer_config_not_json(target: Path) -> None:
    _tokenizer_config_only(target, '{"chat_template": "x",\n "model_max_length": 8,,}')


def _tokenizer_config_not_utf8(target: Path) -> None:
    (target / "chat_template.jinja").unlink()
    (target / "tokenizer_config.json").write_bytes(b'{"chat_template": "\xff"}')


def _tokenizer_config_a_list(target: Path) -> None:
    _tokenizer_config_only(target, '[{"chat_template": "x"}]')


def _no_tokenizer_json(target: Path) -> None:
    (target / "tokenizer.json").unlink()


def _tokenizer_json_truncated(target: Path) -> None:
    path = target / "tokenizer.json"
    path.write_bytes(path.read_bytes()[:1000])


def _tokenizer_config_nested_beside_jinja(target: Path) -> None:
    """transformers reads tokenizer_config.json even where chat_template.jinja holds the template."""
    depth = 100_000
    (target / "tokenizer_config.json").write_text('{"x": ' + "[" * depth + "]" * depth + "}")


def _tokenizer_config_not_utf8_beside_jinja(target: Path) -> None:
    (target / "tokenizer_config.json").write_bytes(b'{"model_max_length": 4096, "x": "\xff"}')


# (how the copy is broken, what the one line must say)
CASES: dict[str, tuple[Break, list[str]]] = {
    "pickled weights only": (
        _pickled_weights_only,
        ["broken-target", "no *.safetensors weights", "found pytorch_model.bin", "only safetensors"],
    ),
    "no weights": (_no_weights, ["broken-target", "no *.safetensors weights", "found none"]),
    "jinja syntax error": (
        _broken_jinja,
        ["broken-target/chat_template.jinja", "Jinja syntax error at line 4", "{% endfor %}", "endfor"],
    ),
    "template in tokenizer_config.json": (
        _broken_template_in_tokenizer_config,
        ["broken-target/tokenizer_config.json field chat_template", "line 4"],
    ),
    "config.json not json": (_not_json, ["broken-target/config.json", "not valid JSON", "line 2"]),
    "no num_hidden_layers": (
        lambda t: _edit_config(t, num_hidden_layers=None),
        ["broken-target/config.json", "no num_hidden_layers"],
    ),
    "no hidden_size": (
        lambda t: _edit_config(t, hidden_size=None),
        ["broken-target/config.json", "no hidden_size"],
    ),
    "num_hidden_layers a string": (
        lambda t: _edit_config(t, num_hidden_layers="8"),
        ["broken-target/config.json", "num_hidden_layers must be a positive integer, got '8'"],
    ),
    "unknown model_type": (
        lambda t: _edit_config(t, model_type="llama_from_the_future"),
        ["broken-target/config.json", "model_type 'llama_from_the_future'"],
    ),
    "no model_type": (
        lambda t: _edit_config(t, model_type=None),
        ["broken-target/config.json", "no model_type"],
    ),
    "config.json nested too deeply": (
        _nested_too_deeply,
        ["broken-target/config.json", "not readable JSON", "nested too deeply"],
    ),
    "tokenizer_config.json nested too deeply": (
        _tokenizer_config_nested_too_deeply,
        ["broken-target/tokenizer_config.json", "not readable JSON", "nested too deeply"],
    ),
    "tokenizer_config.json not json": (
        _tokenizer_config_not_json,
        ["broken-target/tokenizer_config.json", "not valid JSON", "line 2 column"],
    ),
    "tokenizer_config.json not utf-8": (
        _tokenizer_config_not_utf8,
        ["broken-target/tokenizer_config.json", "not UTF-8 text", "at byte 19"],
    ),
    "tokenizer_config.json a list": (
        _tokenizer_config_a_list,
        ["broken-target/tokenizer_config.json", "expected a JSON object, got list"],
    ),
    "no tokenizer.json": (_no_tokenizer_json, ["broken-target: no tokenizer.json", "fast tokenizer"]),
    "tokenizer.json truncated": (
        _tokenizer_json_truncated,
        ["broken-target/tokenizer.json", "not valid JSON", "column"],
    ),
    "tokenizer_config.json nested too deeply beside chat_template.jinja": (
        _tokenizer_config_nested_beside_jinja,
        ["broken-target/tokenizer_config.json", "not readable JSON", "nested too deeply"],
    ),
    "tokenizer_config.json not utf-8 beside chat_template.jinja": (
        _tokenizer_config_not_utf8_beside_jinja,
        ["broken-target/tokenizer_config.json", "not UTF-8 text", "at byte 33"],
    ),
    "hidden_size disagrees with the weights": (
        lambda t: _edit_config(t, hidden_size=256),
        [
            "broken-target/config.json: hidden_size 256 disagrees with the weights",
            "model.embed_tokens.weight in model.safetensors has shape [4096, 128]",
            "the config makes it [4096, 256]",
        ],
    ),
    "vocab_size disagrees with the weights": (
        lambda t: _edit_config(t, vocab_size=5000),
        [
            "broken-target/config.json: vocab_size 5000",
            "model.embed_tokens.weight",
            "[4096, 128]",
            "[5000, 128]",
        ],
    ),
    "num_hidden_layers beyond the weights": (
        lambda t: _edit_config(t, num_hidden_layers=9),
        ["broken-target/config.json: num_hidden_layers 9", "they hold 8 layers, none named model.layers.8.*"],
    ),
    "too few layers for the default aux layers": (
        lambda t: _edit_config(t, num_hidden_layers=4),
        ["4 layers", "broken-target/config.json", "set target.aux_layer_ids", "[0, 3]"],
    ),
}


def test_aux_layer_ids_out_of_range_name_the_field_and_the_range(
    toy_target_dir: Path, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _project(tmp_path, store, toy_target_dir, aux="[2, 3, 99]")
    capsys.readouterr()
    line = _one_error_line(main(["--config", str(config), "extract"]), capsys.readouterr().out)
    assert "target.aux_layer_ids [2, 3, 99] must lie in [0, 7]" in line
    assert f"8 layers (num_hidden_layers in {toy_target_dir / 'config.json'})" in line


# every command that loads the target, or only its tokenizer or config, goes through the same check
SERVER = "regenerate: {server: {url: 'http://127.0.0.1:9'}}\n"
COMMAND_CASES = [("extract", "", case) for case in CASES] + [
    (command, extra, case)
    # export reads the target's head (load_target_head) after the same check
    for command, extra in (("regenerate", ""), ("regenerate", SERVER), ("eval", ""), ("export", ""))
    for case in (
        "pickled weights only",
        "jinja syntax error",
        "unknown model_type",
        "config.json nested too deeply",
        "tokenizer_config.json nested too deeply",
        "tokenizer_config.json not json",
        "hidden_size disagrees with the weights",
    )
    # through a server, no weights are read here, so none is compared with the config
    if not (extra and case in ("pickled weights only", "hidden_size disagrees with the weights"))
]


@pytest.mark.parametrize(
    ("command", "extra", "case"),
    COMMAND_CASES,
    ids=[f"{c}{' through a server' if e else ''}: {k}" for c, e, k in COMMAND_CASES],
)
def test_every_command_that_loads_the_target_checks_it(
    command: str,
    extra: str,
    case: str,
    toy_target_dir: Path,
    store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    breaks, expected = CASES[case]
    config = _project(tmp_path, store, _broken_copy(toy_target_dir, tmp_path, breaks), extra)
    capsys.readouterr()
    line = _one_error_line(main(["--config", str(config), command]), capsys.readouterr().out)
    assert all(text in line for text in expected), line


def test_a_directory_without_weights_serves_what_needs_only_the_tokenizer(
    toy_target_dir: Path, tmp_path: Path
) -> None:
    """Regeneration through a server and bench-sglang read the tokenizer and config only."""
    copy = _broken_copy(toy_target_dir, tmp_path, CASES["pickled weights only"][0])
    check_target_dir(copy, TargetConfig(path=str(copy)), weights=False)
    with pytest.raises(TargetError, match=r"no \*\.safetensors weights"):
        check_target_dir(copy, TargetConfig(path=str(copy)))


def test_sglang_extraction_checks_the_target_before_reaching_the_server(
    toy_target_dir: Path, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = toy_target_dir
    config = write_config(
        tmp_path / "project",
        f"store: {store}\n{DATA}target: {{path: {target}, aux_layer_ids: [2, 3, 99], "
        "backend: {kind: sglang_http, url: 'http://127.0.0.1:9'}}\n",
    )
    capsys.readouterr()
    line = _one_error_line(main(["--config", str(config), "extract"]), capsys.readouterr().out)
    assert "target.aux_layer_ids [2, 3, 99] must lie in [0, 7]" in line


def test_the_console_script_prints_one_line_and_exits_2(
    toy_target_dir: Path, store: Path, tmp_path: Path
) -> None:
    target = _broken_copy(toy_target_dir, tmp_path, _pickled_weights_only)
    config = _project(tmp_path, store, target)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "eagle3"), "--config", str(config), "extract"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip().splitlines() == [done.stdout.strip()]
    assert str(target) in done.stdout and "pytorch_model.bin" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_an_index_naming_a_missing_weight_file_is_refused(toy_target_dir: Path, tmp_path: Path) -> None:
    target = _broken_copy(toy_target_dir, tmp_path, lambda _: None)
    weights = {p.name for p in target.glob("*.safetensors")}
    index = {
        "metadata": {},
        "weight_map": {"a.weight": sorted(weights)[0], "b.weight": "model-2.safetensors"},
    }
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TargetError, match=r"model\.safetensors\.index\.json names weight files .*model-2"):
        safetensors_weights(target)


def test_the_intact_toy_target_passes_the_checks(toy_target_dir: Path) -> None:
    check_target_dir(toy_target_dir, TargetConfig())
    check_target_dir(toy_target_dir, TargetConfig(aux_layer_ids=(0, 3, 7)))


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_that_links_to_a_device_is_refused_unread(
    name: str, toy_target_dir: Path, tmp_path: Path
) -> None:
    """transformers would read /dev/zero until memory runs out; the check never opens what is not a file."""
    target = _broken_copy(toy_target_dir, tmp_path, lambda t: (t / name).unlink())
    (target / name).symlink_to("/dev/zero")
    with pytest.raises(TargetError) as err:
        check_target_dir(target, TargetConfig(path=str(target)), weights=False)
    assert str(err.value) == f"{target / name}: not a regular file (a link to /dev/zero)"


def test_a_tokenizer_file_past_the_size_limit_is_refused_without_reading_it_whole(
    toy_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("eagle3_core.data.tokenize.MAX_TOKENIZER_FILE_BYTES", 1000)
    target = _broken_copy(toy_target_dir, tmp_path, lambda _: None)
    with pytest.raises(TargetError, match=r"broken-target/tokenizer\.json: larger than 1000 bytes"):
        check_target_dir(target, TargetConfig(path=str(target)), weights=False)
