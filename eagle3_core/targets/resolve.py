"""Which model directory a config means (a Hugging Face directory; the toy target eagle3 trains; a named GGUF
target such as `smollm2`, or a `*.gguf` file, which eagle3 turns into a directory), and which backend computes
its hidden states at extraction (`target.backend`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_core.config import (
    Eagle3Config,
    SGLangEngineBackendConfig,
    SGLangHttpBackendConfig,
    SGLangServerBackendConfig,
    TargetConfig,
    TransformersBackendConfig,
    without_url_passwords,
)
from eagle3_core.conventions import check_aux_layer_ids, default_aux_layer_ids
from eagle3_core.data.tokenize import check_chat_template, check_tokenizer_files
from eagle3_core.errors import TargetError
from eagle3_core.store.atomic import read_json_object
from eagle3_core.targets.base import ExtractionTarget
from eagle3_core.targets.gguf import ensure_gguf_target, gguf_source, is_gguf_target
from eagle3_core.targets.weights import SAFETENSORS_INDEX, check_weight_shapes, read_index

CONFIG_FILE = "config.json"
# Weight files of other formats, named in the message when a directory has no safetensors
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.pkl")


def target_dir(cfg: Eagle3Config, log: Callable[[str], None] = print, *, weights: bool = True) -> Path:
    """The target's model directory, checked (`check_target_dir`): every command that loads the target,
    or only its tokenizer or config (`weights=False`: regeneration through a server needs no weights here),
    comes through here."""
    if cfg.target.path == "toy":
        from eagle3_core.toy.build import ensure_toy_target

        path = ensure_toy_target(cfg.cache_root, cfg.target.toy.size, cfg.target.toy.seed, log=log)
    elif is_gguf_target(cfg.target.path):  # a named target (smollm2) or a *.gguf file, built into the cache
        source = gguf_source(cfg.target.path, cfg.resolve)
        path = ensure_gguf_target(cfg.cache_root, source, log=log)
    else:
        path = cfg.resolve(cfg.target.path)
    check_target_dir(path, cfg.target, weights=weights)
    return path


def check_target_dir(model_dir: Path, target: TargetConfig, *, weights: bool = True) -> None:
    """Raise TargetError or ConfigError, naming the file or field, unless eagle3 can load the directory with
    `target`'s settings.

    Checked here, before transformers reads anything, because its own errors come as tracebacks that name
    neither the file nor the field (a missing weight file is an OSError about pickles, a config.json whose
    sizes disagree with the weights a page-long size-mismatch report, a broken template fails only at the
    first render, a missing or truncated tokenizer.json a traceback about sentencepiece or JSON).
    """
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise TargetError(
            f"target.path: {model_dir} is not a Hugging Face model directory (no {CONFIG_FILE})"
        )
    num_layers = config_num_layers(config_path)
    if weights:
        safetensors_weights(model_dir)
        check_weight_shapes(model_dir)
    where = f"num_hidden_layers in {config_path}"
    if target.aux_layer_ids:
        check_aux_layer_ids(target.aux_layer_ids, num_layers, where)
    else:
        default_aux_layer_ids(num_layers, where)
    check_tokenizer_files(model_dir)
    check_chat_template(model_dir)


def safetensors_weights(model_dir: Path) -> list[Path]:
    """The directory's *.safetensors files, every one its index names included; pickled weights never load."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        others = sorted(p.name for pattern in OTHER_WEIGHTS for p in model_dir.glob(pattern))
        found = (
            f"found {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}" if others else "found none"
        )
        raise TargetError(
            f"target.path: {model_dir} has no *.safetensors weights ({found}); eagle3 loads only safetensors "
            "weights, never pickled ones (.bin, .pt): download or convert the safetensors files"
        )
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        missing = sorted(set(read_index(index).weight_map.values()) - {p.name for p in weights})
        if missing:
            raise TargetError(f"{index} names weight files {model_dir} does not have: {', '.join(missing)}")
    return weights


def config_num_layers(config_path: Path) -> int:
    """num_hidden_layers of a config.json transformers can load (a known model_type, and a hidden_size)."""
    outer = read_json_object(config_path, TargetError)
    model_type = outer.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise TargetError(f"{config_path}: no model_type; transformers needs it to choose the architecture")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise TargetError(
            f"{config_path}: model_type {model_type!r} is not one this version of transformers knows "
            "(a newer transformers may; models that need trust_remote_code are not loaded)"
        )
    config = outer.get("text_config", outer)  # a multimodal target keeps its language model's config inside
    if not isinstance(config, dict):
        raise TargetError(f"{config_path}: text_config must be an object, got {type(config).__name__}")
    num_layers = _positive_int(config, "num_hidden_layers", config_path)
    _positive_int(config, "hidden_size", config_path)
    return num_layers


def _positive_int(config: dict[str, Any], key: str, config_path: Path) -> int:
    value = config.get(key)
    if value is None:
        raise TargetError(f"{config_path}: no {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TargetError(f"{config_path}: {key} must be a positive integer, got {value!r}")
    return value


Opener = Callable[[Any, Path, Eagle3Config, Callable[[str], None]], ExtractionTarget]


def _open_transformers(
    backend: TransformersBackendConfig, model_dir: Path, cfg: Eagle3Config, log: Callable[[str], None]
) -> ExtractionTarget:
    from eagle3_core.targets.hf import TransformersTarget

    return TransformersTarget(model_dir, cfg.target)


def _open_sglang_http(
    backend: SGLangHttpBackendConfig, model_dir: Path, cfg: Eagle3Config, log: Callable[[str], None]
) -> ExtractionTarget:
    from eagle3_core.targets.sglang import SGLangHttpBackend

    log(f"hidden states from the SGLang server at {without_url_passwords(backend.url)}")
    return SGLangHttpBackend(backend.url, model_dir, cfg.target, max_seq_len=cfg.tokenize.max_seq_len)


def _open_sglang_engine(
    backend: SGLangEngineBackendConfig, model_dir: Path, cfg: Eagle3Config, log: Callable[[str], None]
) -> ExtractionTarget:
    from eagle3_core.targets.sglang import SGLangEngineBackend

    log(f"starting sglang.Engine over {model_dir} (tp {cfg.sglang.tp_size}, device {cfg.target.device})")
    return SGLangEngineBackend(
        model_dir,
        cfg.target,
        tp_size=cfg.sglang.tp_size,
        mem_fraction_static=cfg.sglang.mem_fraction_static,
        device=cfg.target.device,
        max_total_tokens=cfg.sglang.max_total_tokens,
        max_seq_len=cfg.tokenize.max_seq_len,
    )


def _open_sglang_server(
    backend: SGLangServerBackendConfig, model_dir: Path, cfg: Eagle3Config, log: Callable[[str], None]
) -> ExtractionTarget:
    from eagle3_core.targets.sglang import SGLangManagedBackend

    return SGLangManagedBackend(model_dir, cfg, log=log)


# one opener per member of config.Backend; each imports its backend's module (SGLang's lazily) only when used
OPENERS: dict[type[Any], Opener] = {
    TransformersBackendConfig: _open_transformers,
    SGLangHttpBackendConfig: _open_sglang_http,
    SGLangEngineBackendConfig: _open_sglang_engine,
    SGLangServerBackendConfig: _open_sglang_server,
}


def open_extraction_target(cfg: Eagle3Config, log: Callable[[str], None] = print) -> ExtractionTarget:
    """The hidden-state backend `target.backend` names (transformers unless set otherwise)."""
    model_dir = target_dir(cfg, log=log)
    return OPENERS[type(cfg.target.backend)](cfg.target.backend, model_dir, cfg, log)
