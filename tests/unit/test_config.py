import time
from pathlib import Path

import pytest

from eagle3_core.config import (
    BACKEND_KINDS,
    ConfigError,
    SGLangEngineBackendConfig,
    SGLangHttpBackendConfig,
    SGLangServerBackendConfig,
    TransformersBackendConfig,
    config_from_dict,
    load_config,
    without_url_passwords,
)
from tests.conftest import write_config


def test_defaults_and_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path / "proj", "store: data/store\n"))
    assert cfg.store_root == (tmp_path / "proj" / "data" / "store").resolve()
    assert cfg.data.shard_size == 256
    assert cfg.tokenize.max_seq_len == 4096
    assert cfg.regenerate.temperature == 0.0
    assert cfg.regenerate.kv_cache == "dynamic"
    assert cfg.regenerate.step == "generate"


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("data: {shard_size: 0}\n", "data.shard_size", "greater than 0"),
        ("data: {holdout_fraction: 1.5}\n", "data.holdout_fraction", "less than 1"),
        ("regenerate: {temperature: -1}\n", "regenerate.temperature", "greater than or equal to 0"),
        ("target: {aux_layer_ids: [2, 2, 5]}\n", "target.aux_layer_ids", "distinct"),
        ("target: {aux_layer_ids: [30, 2, 58]}\n", "target.aux_layer_ids", "ascending layer order"),
        ("extract: {store_dtype: int8}\n", "extract.store_dtype", "bfloat16"),
        ("regenerate: {kv_cache: paged}\n", "regenerate.kv_cache", "'static'"),
        ("regenerate: {step: compiled}\n", "regenerate.step", "'batched'"),
        ("regenerate: {samples: 0, temperature: 0.7}\n", "regenerate.samples", "greater than 0"),
        ("regenerate: {samples: 65, temperature: 0.7}\n", "regenerate.samples", "less than or equal to 64"),
        ("data: {shard_sise: 10}\n", "data.shard_sise", "Extra inputs"),
        ("data: {sources: [{kind: file}]}\n", "data.sources.0.path", "Field required"),
        ("data: {dataset: My-Data}\n", "data.dataset", "pattern"),
        ("orchestration: {training: k8s}\n", "orchestration", "orchestration.k8s is required"),
        ("orchestration: {k8s: {image: e, volumes: {store: c}}}\n", "orchestration.k8s.volumes", "absolute"),
        (
            "orchestration: {k8s: {image: e, pod_spec: {containers: []}}}\n",
            "orchestration.k8s.pod_spec",
            "set by eagle3",
        ),
    ],
)
def test_invalid_values_name_the_field(tmp_path: Path, text: str, field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, text))
    message = str(err.value)
    assert f"{field}:" in message, message
    assert fragment in message, message


def test_cross_field_check_names_both_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"regenerate.max_new_tokens .* tokenize.max_seq_len"):
        load_config(
            write_config(tmp_path, "regenerate: {max_new_tokens: 600}\ntokenize: {max_seq_len: 512}\n")
        )


def test_several_replies_per_conversation_need_sampling_and_the_refusal_names_both_fields(
    tmp_path: Path,
) -> None:
    assert load_config(write_config(tmp_path, "store: s\n")).regenerate.samples == 1
    with pytest.raises(ConfigError, match=r"regenerate\.samples \(2\) needs regenerate\.temperature > 0"):
        load_config(write_config(tmp_path, "regenerate: {samples: 2}\n"))
    cfg = load_config(write_config(tmp_path, "regenerate: {samples: 2, temperature: 0.7}\n"))
    assert (cfg.regenerate.samples, cfg.regenerate.temperature) == (2, 0.7)


def test_missing_file_and_bad_yaml_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write_config(tmp_path, "data: [unclosed\n"))


def test_launchpad_overrides_merge_field_by_field_and_are_validated_like_the_file(tmp_path: Path) -> None:
    from eagle3_dagster.defs.resources import Eagle3Resource

    path = write_config(tmp_path, "store: s\ntrain: {epochs: 5, lr: 0.01}\nevaluate: {ks: [3, 7]}\n")
    resource = Eagle3Resource(
        config_path=str(path), overrides="train: {epochs: 1}\nevaluate: {ks: [2], gate_k: 2}"
    )
    cfg = resource.config()
    assert (cfg.train.epochs, cfg.train.lr, cfg.evaluate.ks) == (1, 0.01, [2])  # lr kept, ks replaced
    assert cfg.store_root == tmp_path / "s"  # paths still resolve against the file
    assert load_config(path).train.epochs == 5
    with pytest.raises(ConfigError, match=r"(?s)with overrides.*train\.epochs"):
        load_config(path, "train: {epochs: 0}")
    with pytest.raises(ConfigError, match=r"\(overrides\): the top level must be a mapping"):
        load_config(path, "- 1")


# ---- target.backend: a union on `kind` ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("store: s\n", TransformersBackendConfig()),
        ("target: {backend: {kind: transformers}}\n", TransformersBackendConfig()),
        ("target: {backend: transformers}\n", TransformersBackendConfig()),
        ("target: {backend: {kind: sglang_engine}}\n", SGLangEngineBackendConfig()),
        ("target: {backend: sglang_engine}\n", SGLangEngineBackendConfig()),
        ("target: {backend: sglang_server}\n", SGLangServerBackendConfig()),
        (
            "target: {backend: {kind: sglang_http, url: 'http://127.0.0.1:30000'}}\n",
            SGLangHttpBackendConfig(url="http://127.0.0.1:30000"),
        ),
    ],
)
def test_each_backend_kind_parses_and_a_kind_alone_is_its_shorthand(
    tmp_path: Path, text: str, expected: object
) -> None:
    assert load_config(write_config(tmp_path, text)).target.backend == expected


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "target: {backend: sglang_http, sglang_url: 'http://h:1'}\n",
            "  target: Value error, target.sglang_url is no longer read: the URL of backend sglang_http is now "
            "written target.backend: {kind: sglang_http, url: 'http://h:1'}",
        ),
        (
            "target: {backend: sglang_http}\n",
            "  target.backend: Value error, backend sglang_http needs the server's URL: write target.backend: "
            "{kind: sglang_http, url: 'http://HOST:PORT'} (got 'sglang_http')",
        ),
        ("target: {backend: {kind: sglang_http}}\n", "  target.backend.url: Field required"),
        (
            "target: {backend: {kind: sglang_http, url: 'localhost:30000'}}\n",
            "  target.backend.url: String should match pattern '^https?://\\S+$' (got 'localhost:30000')",
        ),
        (
            "target: {backend: vllm}\n",
            "  target.backend: Value error, a backend's kind is one of transformers, sglang_http, sglang_engine, "
            "sglang_server (got 'vllm')",
        ),
        (
            "target: {backend: {kind: vllm}}\n",
            "  target.backend: Value error, a backend's kind is one of transformers, sglang_http, sglang_engine, "
            "sglang_server (got 'vllm')",
        ),
        (
            "target: {backend: {url: 'http://h:1'}}\n",
            "  target.backend: Value error, a backend's kind is one of transformers, sglang_http, sglang_engine, "
            "sglang_server (no kind given)",
        ),
        (
            "target: {backend: {kind: transformers, url: 'http://h:1'}}\n",
            "  target.backend.url: Extra inputs are not permitted (got 'http://h:1')",
        ),
    ],
)
def test_a_bad_backend_is_refused_in_one_line_naming_the_field(tmp_path: Path, text: str, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, text))
    assert str(err.value).splitlines()[1:] == [line]


def test_every_backend_kind_has_an_opener() -> None:
    from eagle3_core.targets.resolve import OPENERS

    assert tuple(member.model_fields["kind"].default for member in OPENERS) == BACKEND_KINDS


def test_an_override_of_another_backend_kind_replaces_the_file_s(tmp_path: Path) -> None:
    path = write_config(tmp_path, "target: {backend: {kind: sglang_http, url: 'http://h:1'}}\n")
    assert load_config(path, "target: {backend: {kind: sglang_engine}}").target.backend == (
        SGLangEngineBackendConfig()
    )
    moved = load_config(path, "target: {backend: {url: 'http://h:2'}}").target.backend
    assert moved == SGLangHttpBackendConfig(url="http://h:2")  # same kind: merged field by field


# ---- what the file itself, and the directories it names, must be -------------------------------------------
@pytest.mark.parametrize(
    ("text", "field", "blocked"),
    [
        ("store: taken\n", "store", "{root}/taken is a file"),
        ("store: taken/store\n", "store", "{root}/taken/store cannot be a directory: {root}/taken is a file"),
        ("cache: taken\n", "cache", "{root}/taken is a file"),
    ],
)
def test_a_store_or_cache_where_a_file_is_is_refused_in_one_line(
    tmp_path: Path, text: str, field: str, blocked: str
) -> None:
    (tmp_path / "taken").write_text("a user's file, never to be touched\n")
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    root = tmp_path.resolve()
    assert str(err.value) == (
        f"{path}: {field}: {blocked.format(root=root)}; name a directory (created if absent)"
    )
    assert (tmp_path / "taken").read_text() == "a user's file, never to be touched\n"


def test_a_store_that_does_not_exist_yet_or_is_a_directory_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "existing").mkdir()
    assert load_config(write_config(tmp_path, "store: existing\n")).store_root == tmp_path / "existing"
    assert load_config(write_config(tmp_path, "store: new/store\n")).store_root == tmp_path / "new" / "store"
    assert not (tmp_path / "new").exists()  # loading a config creates nothing


def test_a_config_that_is_not_utf8_names_the_file_and_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "eagle3.yaml"
    path.write_bytes("store: caf\u00e9\n".encode("latin-1"))  # what a latin-1 editor saves
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (
        str(err.value) == f"{path}: not UTF-8 text (invalid continuation byte at byte 10); save it as UTF-8"
    )


def test_a_config_nested_too_deeply_is_refused_in_one_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, "store: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: not readable YAML: collections nested too deeply for the parser"


def test_a_config_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not a file \(--config names the YAML file itself\)"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://user:secret@host:8000", "http://user:***@host:8000"),
        ("https://user:secret@host/v1?x=1", "https://user:***@host/v1?x=1"),
        ("http://user:se@cr/et@host:8000/v1", "http://user:***@host:8000/v1"),  # "@" and "/" unescaped
        ("http://:secret@host", "http://:***@host"),
        (
            "server at http://a:secret@h1 and http://b:secret@h2 is down",
            "server at http://a:***@h1 and http://b:***@h2 is down",
        ),
        ("(got 'ftp://user:secret@host')", "(got 'ftp://user:***@host')"),
        # nothing to hide: no password, or no userinfo at all
        ("http://user@host:8000/v1", "http://user@host:8000/v1"),
        ("http://127.0.0.1:30000/generate", "http://127.0.0.1:30000/generate"),
        ("no URL: a:b@c", "no URL: a:b@c"),
    ],
)
def test_a_urls_password_is_shown_as_stars_its_user_and_host_kept(text: str, shown: str) -> None:
    assert without_url_passwords(text) == shown


def test_a_url_the_config_refuses_is_quoted_without_its_password(tmp_path: Path) -> None:
    config = write_config(tmp_path, "store: s\nregenerate: {server: {url: 'ftp://user:secret@host'}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert "regenerate.server.url" in str(err.value) and "ftp://user:***@host" in str(err.value)
    assert "secret" not in str(err.value)


def test_a_rendezvous_must_be_a_host_and_a_port(tmp_path: Path) -> None:
    for bad in (
        "gpu-001",
        "gpu-001:",
        ":29400",
        "gpu-001:65536",
        "gpu-001:0",
        "gpu-001:http",
        "a b:1",
        "::1:80",
    ):
        with pytest.raises(ConfigError) as err:
            load_config(write_config(tmp_path, f"train: {{rendezvous: '{bad}'}}\n"))
        [line] = [line for line in str(err.value).splitlines() if "train.rendezvous" in line]
        assert line.startswith("  train.rendezvous: Value error, host:port") and "1 to 65535" in line, line
    for good in ("gpu-001:29400", "10.0.0.1:65535", "[::1]:29400", "eagle3-train-0.eagle3-train:29400"):
        assert (
            load_config(write_config(tmp_path, f"train: {{rendezvous: '{good}'}}\n")).train.rendezvous == good
        )


def _alias_bomb(levels: int, width: int = 10) -> str:
    """The "billion laughs", under keys the config does not know: each anchor a list of `width` aliases of
    the one before, so that a file of a few hundred bytes expands to width**levels values."""
    lines = ["store: s", f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once_in_one_line_naming_the_file(tmp_path: Path) -> None:
    config = write_config(tmp_path, _alias_bomb(levels=10))  # 10**10 values once expanded
    assert config.stat().st_size < 4096
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert time.monotonic() - started < 1.0
    message = str(err.value)
    assert message.startswith(f"{config}: ") and "\n" not in message, message
    assert "aliases" in message and "expand" in message, message
    with pytest.raises(ConfigError, match=r"\(overrides\): .*aliases"):  # the Launchpad's YAML too
        load_config(write_config(tmp_path, "store: s\n"), _alias_bomb(levels=10))


def test_an_alias_that_contains_itself_is_refused_in_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, "store: s\njunk: &loop [1, *loop]\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value).startswith(f"{config}: ") and "\n" not in str(err.value)
    assert "contains itself" in str(err.value)


def test_a_config_with_a_few_anchors_still_loads(tmp_path: Path) -> None:
    text = (
        "store: s\n"
        "data:\n  dataset: t\n  sources:\n"
        "    - &file {kind: file, path: a.jsonl, format: messages}\n"
        "    - {<<: *file, path: b.jsonl}\n"
        "evaluate: {ks: &ks [1, 2, 3]}\n"
    )
    cfg = load_config(write_config(tmp_path, text))
    assert [s.path for s in cfg.data.sources] == ["a.jsonl", "b.jsonl"]  # type: ignore[union-attr]
    assert cfg.evaluate.ks == [1, 2, 3]


def test_a_rejected_value_is_quoted_in_at_most_a_few_hundred_characters(tmp_path: Path) -> None:
    """Quoting stops at the limit: the whole repr of a large value is huge, and of an aliased one (a dict
    given to config_from_dict, as the Launchpad's is) exponential."""
    value: object = ["lol"] * 10
    for _ in range(8):
        value = [value] * 10  # 10**9 strings, 10 lists deep, in 90 list objects
    long_url = "ftp://user:" + "secret" * 100 + "@host"
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        config_from_dict({"store": "s", "junk": value, "regenerate": {"server": {"url": long_url}}}, tmp_path)
    assert time.monotonic() - started < 1.0
    message = str(err.value)
    assert len(message) < 1000, message[:2000]
    assert "junk: Extra inputs are not permitted (got [[[[" in message and " ...)" in message, message
    assert "regenerate.server.url" in message and "secret" not in message, message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("train: {lr: .inf}\n", "train.lr"),
        ("train: {lr: .nan}\n", "train.lr"),
        ("train: {weight_decay: .inf}\n", "train.weight_decay"),
        ("train: {grad_clip: .inf}\n", "train.grad_clip"),
        ("evaluate: {promotion_tolerance: .inf}\n", "evaluate.promotion_tolerance"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_naming_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    """`train.lr: .inf` trained a run that logged `loss nan` at every step and was exported and promoted."""
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, text))
    [line] = [line for line in str(err.value).splitlines() if line.startswith("  ")]
    assert line.startswith(f"  {field}: Input should be a finite number"), str(err.value)


def _float_fields() -> list[tuple[type, str]]:
    """(model, field) for every field of every config model that takes a float."""
    import typing

    import eagle3_core.config as config

    def takes_float(annotation: object) -> bool:
        return annotation is float or any(takes_float(a) for a in typing.get_args(annotation))

    models, pending = [], list(config._Model.__subclasses__())
    while pending:
        model = pending.pop()
        models.append(model)
        pending += model.__subclasses__()
    return sorted(
        ((m, name) for m in models for name, f in m.model_fields.items() if takes_float(f.annotation)),
        key=lambda pair: (pair[0].__name__, pair[1]),
    )


def test_every_float_setting_refuses_infinity_and_nan() -> None:
    from pydantic import ValidationError

    fields = _float_fields()
    assert ("TrainConfig", "lr") in {(m.__name__, name) for m, name in fields}
    for model, name in fields:
        for value in (float("inf"), float("-inf"), float("nan")):
            with pytest.raises(ValidationError) as err:
                model.model_validate({name: value})  # type: ignore[attr-defined]
            at_field = [e for e in err.value.errors() if e["loc"] == (name,)]
            assert [e["type"] for e in at_field] == ["finite_number"], (model.__name__, name, value)
