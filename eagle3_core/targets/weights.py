"""A target's safetensors weights as their headers describe them (each tensor's file and shape; no tensor is
read), and the check that config.json's sizes agree with them.

The check runs before transformers, SGLang or the head loader reads a weight (`check_target_dir` calls it for
every command that loads the target): a config.json whose hidden_size, vocab_size or num_hidden_layers
disagrees with the weights would otherwise fail as a long transformers traceback, or, for a layer the weights
lack, load with that layer randomly initialised and say nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError, safe_open

from eagle3_core.errors import TargetError
from eagle3_core.store.atomic import read_json_object
from eagle3_core.store.records import validation_message
from eagle3_core.targets.model_config import CONFIG_FILE, DecoderSizes, read_language_fields

SAFETENSORS_INDEX = "model.safetensors.index.json"
EMBED = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "norm.weight"  # beside the embedding: `model.norm.weight`, `model.language_model.norm.weight`


@dataclass(frozen=True)
class TensorHeader:
    file: Path
    shape: tuple[int, ...]


class SafetensorsIndex(BaseModel):
    """model.safetensors.index.json: which file holds each tensor of a sharded checkpoint."""

    model_config = ConfigDict(frozen=True, extra="allow")

    weight_map: dict[str, str]


def read_index(index: Path) -> SafetensorsIndex:
    try:
        return SafetensorsIndex.model_validate(read_json_object(index, TargetError))
    except ValidationError as err:
        raise TargetError(validation_message(index, err)) from None


def weight_files(model_dir: Path) -> list[Path]:
    """The files a load reads: those the index names in a sharded checkpoint, else every *.safetensors."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        return sorted({model_dir / name for name in read_index(index).weight_map.values()})
    return sorted(model_dir.glob("*.safetensors"))


def tensor_headers(model_dir: Path) -> dict[str, TensorHeader]:
    """Every tensor's file and shape, from the safetensors headers alone."""
    tensors: dict[str, TensorHeader] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    tensors[name] = TensorHeader(path, tuple(f.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            raise TargetError(f"{path}: not a readable safetensors file ({e})") from None
    if not tensors:
        raise TargetError(f"{model_dir}: no safetensors weights")
    return tensors


def tensors_ending(tensors: dict[str, TensorHeader], suffix: str, exclude: str = "layers.") -> list[str]:
    """The tensors named `...suffix` outside the decoder layers."""
    return sorted(n for n in tensors if n.endswith(suffix) and exclude not in n)


def find_tensor(tensors: dict[str, TensorHeader], suffix: str) -> str | None:
    """The one tensor named `...suffix` outside the decoder layers; None if there is none."""
    matches = tensors_ending(tensors, suffix)
    if len(matches) > 1:
        raise TargetError(f"several tensors of the target end with {suffix!r}: {matches}")
    return matches[0] if matches else None


def _only(tensors: dict[str, TensorHeader], suffix: str) -> str | None:
    # several (a second model's embedding in a wrapper): which is the decoder's is not guessed; transformers
    # compares them as it loads
    matches = tensors_ending(tensors, suffix)
    return matches[0] if len(matches) == 1 else None


def check_weight_shapes(model_dir: Path) -> None:
    """Raise TargetError naming the config.json field, the tensor and both shapes where the config's sizes
    disagree with the weights: the embedding, output head and final norm (hidden_size, vocab_size) and the
    decoder layers present (num_hidden_layers).

    Only tensors named as transformers' decoders name them are checked (one `*embed_tokens.weight`, the
    `layers.N.*` beside it); other namings are compared by transformers as it loads (`load_causal_lm`), and a
    tensor of another rank (a packed quantized format) by its quantizer.
    """
    sizes, prefix = read_language_fields(model_dir, DecoderSizes)
    tensors = tensor_headers(model_dir)
    embed = _only(tensors, EMBED)
    if embed is None:
        return
    decoder = embed.removesuffix(EMBED)  # "model." or, in a multimodal wrapper, "model.language_model."
    hidden, vocab = ("hidden_size", sizes.hidden_size), ("vocab_size", sizes.vocab_size)
    expected: list[tuple[str | None, tuple[tuple[str, int | None], ...]]] = [
        (embed, (vocab, hidden)),
        (_only(tensors, LM_HEAD), (vocab, hidden)),
        (f"{decoder}{FINAL_NORM}", (hidden,)),
    ]
    where = model_dir / CONFIG_FILE
    for name, dims in expected:
        if name is not None and name in tensors:
            _check_shape(where, prefix, name, tensors[name], dims)
    _check_layers(where, prefix, decoder, tensors, sizes.num_hidden_layers)


def _check_shape(
    where: Path, prefix: str, name: str, header: TensorHeader, dims: tuple[tuple[str, int | None], ...]
) -> None:
    if len(header.shape) != len(dims):
        return  # not stored as a plain matrix or vector (a packed quantized format): its quantizer judges it
    # a size the config leaves out (vocab_size: None) is whatever the weights have
    made = [got if value is None else value for (_, value), got in zip(dims, header.shape, strict=True)]
    if tuple(made) == header.shape:
        return
    fields = [
        f"{prefix}{field} {value}"
        for (field, value), got in zip(dims, header.shape, strict=True)
        if value is not None and value != got
    ]
    raise TargetError(
        f"{where}: {', '.join(fields)} disagree{'s' if len(fields) == 1 else ''} with the weights: {name} in "
        f"{header.file.name} has shape {list(header.shape)}, where the config makes it {made}"
    )


def _check_layers(
    where: Path, prefix: str, decoder: str, tensors: dict[str, TensorHeader], num_layers: int
) -> None:
    """Every layer num_hidden_layers counts must be in the weights (more is allowed: DeepSeek-V3 and GLM keep
    their multi-token-prediction layer after the last decoder layer)."""
    layer = re.compile(rf"{re.escape(decoder)}layers\.(\d+)\.")
    present = {int(m[1]) for name in tensors if (m := layer.match(name))}
    missing = sorted(set(range(num_layers)) - present)
    if present and missing:
        raise TargetError(
            f"{where}: {prefix}num_hidden_layers {num_layers} disagrees with the weights: they hold "
            f"{len(present)} layers, none named {decoder}layers.{missing[0]}.*"
        )
