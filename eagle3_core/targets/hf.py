"""The in-process transformers target: loading, fingerprints, and the hidden-state backend.

Aux states are captured with forward pre-hooks on the chosen decoder layers (the residual stream entering
layer k), so only those three tensors are kept, not all L+1 that `output_hidden_states` would hold; the
final state is the decoder's `last_hidden_state` (after the final norm: `post_norm`). Batches are padded on
the right: with causal attention, padding never changes the rows of real tokens, and no padding is returned.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3_core.config import TargetConfig
from eagle3_core.conventions import check_aux_layer_ids, default_aux_layer_ids
from eagle3_core.errors import ConfigError, TargetError
from eagle3_core.store.fp8 import FP8, SCALE_DTYPE, SOURCE_DTYPE, NonFiniteStates, quantize_rows
from eagle3_core.targets.base import HiddenStates, SampleFailure, TargetInfo
from eagle3_core.targets.gpu_memory import release_gpu_memory
from eagle3_core.targets.model_config import CONFIG_FILE
from eagle3_core.targets.resolve import safetensors_weights

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("target.device is 'cuda' but no CUDA device is visible")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _hash_files(directory: Path, names: Sequence[str]) -> str:
    h = hashlib.sha256()
    for name in names:
        path = directory / name
        if path.exists():
            h.update(name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def tokenizer_fingerprint(model_dir: Path) -> str:
    """sha256 of the tokenizer files, chat template included."""
    return _hash_files(model_dir, TOKENIZER_FILES)


def target_fingerprint(model_dir: Path) -> str:
    """sha256 of the config and of each weight file's safetensors header and size.

    Hashing terabytes of weights at every run is not affordable; the headers name every tensor with its
    shape and byte range, and with the sizes they identify a checkpoint in practice.
    """
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).exists():
            h.update((model_dir / name).read_bytes())
    for path in safetensors_weights(model_dir):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(path.name.encode())
            h.update(f.read(n))
        h.update(str(path.stat().st_size).encode())
    return h.hexdigest()


def load_causal_lm(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The model, refused in one line where a weight's shape disagrees with the one config.json makes.

    check_target_dir compares the sizes that name a field (hidden_size, vocab_size, num_hidden_layers) before
    this; any other disagreement (intermediate_size, the heads) transformers finds as it loads. It is asked
    to list them rather than raise, since its error is a traceback pointing at a report it logged above.
    """
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, use_safetensors=True, ignore_mismatched_sizes=True, output_loading_info=True
    )
    model, loading = loaded
    mismatched = sorted(loading["mismatched_keys"])
    if mismatched:
        name, in_weights, in_model = mismatched[0]
        more = f" (and {len(mismatched) - 1} more tensors)" if len(mismatched) > 1 else ""
        raise TargetError(
            f"{model_dir / CONFIG_FILE}: its sizes disagree with the weights: {name} has shape "
            f"{list(in_weights)} in the weights, where the config makes it {list(in_model)}{more}"
        )
    return model.to(device).eval()


def decoder_layers(model: Any) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__}: cannot find the decoder layers (expected model.get_decoder().layers)"
        )
    return layers


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Copy to CPU through pinned memory: pageable copies of fresh memory run at a fraction of the link's speed.

    PyTorch's caching host allocator hands the pinned blocks back to later batches once these are freed.
    """
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def _quantized_packed(
    states: torch.Tensor, lengths: Sequence[int], groups: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The real rows of padded `states` [B, S, groups * H] quantised on their device (store/fp8.py), then
    on the host: FP8 [N, groups * H] and scales [N, groups] packed without padding, and each sample's
    count of non-finite values.

    Sample by sample, as the shard writer quantises: the device's working memory is one sample's float32
    copy, not the batch's, and a NaN in one sample (or in the padding) fails no other."""
    total, width, device = sum(lengths), states.shape[-1], states.device
    values = torch.empty(total, width, dtype=FP8, device=device)
    scales = torch.empty(total, groups, dtype=SCALE_DTYPE, device=device)
    bad = torch.empty(len(lengths), dtype=torch.int64, device=device)
    start = 0
    for b, n in enumerate(lengths):
        q, bad_rows = quantize_rows(states[b, :n], groups)
        values[start : start + n] = q.values
        scales[start : start + n] = q.scales
        bad[b] = bad_rows.sum()  # on the device: no sync per sample
        start += n
    return _to_host(values), _to_host(scales), _to_host(bad).tolist()


def _quantized_samples(
    aux: torch.Tensor, last: torch.Tensor, lengths: Sequence[int], num_aux: int
) -> list[HiddenStates | SampleFailure]:
    """Each sample's FP8 states and scales, or the failure the shard writer would have recorded for it."""
    aux_q, aux_s, aux_bad = _quantized_packed(aux, lengths, num_aux)
    last_q, last_s, last_bad = _quantized_packed(last, lengths, 1)
    pieces = zip(*(t.split(list(lengths)) for t in (aux_q, last_q, aux_s, last_s)), strict=True)
    out: list[HiddenStates | SampleFailure] = []
    for (a, z, a_s, z_s), a_bad, z_bad in zip(pieces, aux_bad, last_bad, strict=True):
        # the writer quantises aux first and stops at its count: the same reason, whichever side quantised
        bad = a_bad or z_bad
        out.append(SampleFailure(NonFiniteStates(bad).reason) if bad else HiddenStates(a, z, a_s, z_s))
    return out


class TransformersTarget:
    """Hidden states from a Hugging Face causal LM running in this process (fp32 on CPU, bf16 on GPU)."""

    quantizes_on_device = True  # hidden_states(batch, FP8): quantised on the model's device, before the copy

    def __init__(self, model_dir: Path, cfg: TargetConfig) -> None:
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer_fingerprint = tokenizer_fingerprint(model_dir)
        self.model = load_causal_lm(model_dir, device, dtype)
        self.decoder: Any = self.model.get_decoder()
        self.layers = decoder_layers(self.model)
        config: Any = self.model.config
        num_layers = len(self.layers)
        aux = (
            check_aux_layer_ids(cfg.aux_layer_ids, num_layers)
            if cfg.aux_layer_ids
            else default_aux_layer_ids(num_layers)
        )
        self.info = TargetInfo(
            name=str(model_dir),
            fingerprint=target_fingerprint(model_dir),
            num_layers=num_layers,
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            aux_layer_ids=aux,
            final_state_convention="post_norm",
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
        )
        self._aux: torch.Tensor | None = None  # [B, S, 3H] for the batch in flight
        for j, k in enumerate(aux):
            self.layers[k].register_forward_pre_hook(self._capture_hook(j), with_kwargs=True)

    def _capture_hook(self, j: int) -> Any:
        h = self.info.hidden_size

        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._aux is not None:  # copy_ converts in the same pass: no concat, no second cast
                self._aux[..., j * h : (j + 1) * h].copy_(args[0] if args else kwargs["hidden_states"])

        return hook

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def hidden_states(
        self, batch: Sequence[Sequence[int]], dtype: torch.dtype | None = None
    ) -> list[HiddenStates | SampleFailure]:
        lengths = [len(s) for s in batch]
        width = max(lengths)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, seq in enumerate(batch):
            input_ids[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            attention_mask[b, : len(seq)] = 1
        quantized = dtype == FP8
        # FP8 is quantised from bfloat16, as the shard writer quantises what a target hands it: the same bytes
        handover = SOURCE_DTYPE if quantized else (dtype or self.model.dtype)
        num_aux = len(self.info.aux_layer_ids)
        self._aux = torch.empty(
            len(batch), width, num_aux * self.info.hidden_size, dtype=handover, device=self.device
        )
        try:
            out = self.decoder(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                use_cache=False,
            )
            aux = self._aux
        finally:
            self._aux = None
        last = out.last_hidden_state.to(handover)  # [B, S, H]
        if quantized:
            return _quantized_samples(aux, last, lengths, num_aux)
        aux, last = _to_host(aux), _to_host(last)
        return [HiddenStates(aux[b, :n], last[b, :n]) for b, n in enumerate(lengths)]

    def close(self, timeout_s: float = 60.0) -> float:
        """Drop the weights and wait until the GPU memory is given back (the pool is shared with training).

        Returns the seconds waited; raises GpuMemoryNotReleased if memory is still held after `timeout_s`.
        """
        del self.model, self.decoder, self.layers
        return release_gpu_memory(timeout_s)
