"""The target's step as an engine runs it: a preallocated KV cache and, on a GPU, one CUDA graph per width.

transformers' eager forward at batch 1 spends most of its 10-20 ms a step launching kernels and running
Python (bench/results/specdec_profile_h200.json), so speculative decoding against it measures the host, not
the drafter: an engine (SGLang, vLLM) replays CUDA graphs. `GraphedTarget` computes the same forward from the
model's own modules (embedding, norms, projections, MLPs, rotary embedding, head) with the keys and values
in one buffer, positions as tensors, and attention masked by position (key slot j is seen by the query at
position p iff j <= p), so every step of a width has one shape and no host-side decision: it can be
captured once and replayed. Rejected drafts need no crop: their slots lie beyond every later query's
position until they are written again.

Decoder-only models whose layers are attention (`q_proj`, `k_proj`, `v_proj`, `o_proj`, optional `q_norm`
and `k_norm` per head) plus an MLP, with full attention on every layer and the rotary embedding at
`model.model.rotary_emb` (Llama, Mistral, Qwen2, Qwen3, SmolLM2) are supported; anything else is refused in
one line, and measured with the eager forward instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from eagle3_core.errors import ConfigError, Eagle3Error

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
# the families whose forward is exactly embedding, (norm, attention, norm, MLP) per layer, norm, head: others
# add what the step would silently leave out (Gemma's embedding scale and extra norms, say)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PROBE_TOKENS = 12
# relative L2 error of the probe's logits and aux states against transformers' forward
PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
PROBE_TOLERANCE_LOW_PRECISION = 5e-2  # bf16, fp16: rounding through 30 layers moves logits by a few %


TargetStep = Literal["auto", "eager", "graphed"]


class UnsupportedTargetError(Eagle3Error):
    """The target's architecture is not one the graphed step computes."""


def choose_target_step(
    step: TargetStep, model: Any, aux_layer_ids: tuple[int, ...], device_type: str
) -> tuple[bool, str]:
    """(whether evaluate.target_step `step` decodes `model` on a `device_type` device with the graphed step,
    why): eager never; auto only on a GPU (a CPU has no CUDA graphs, and eager is what the CPU figures were
    made with); otherwise the graphed step where it computes `model`, found as a run would find it (the
    family, the aux layers, and the probe against transformers' forward, on 12 tokens): graphed refuses a
    model it cannot compute (ConfigError), auto takes eager instead and says why."""
    if step == "eager":
        return False, "evaluate.target_step eager"
    if step == "auto" and device_type != "cuda":
        return False, f"evaluate.target_step auto: graphed only on a GPU, this is {device_type}"
    try:
        GraphedTarget(model, aux_layer_ids, capacity=PROBE_TOKENS, graphs=False)
    except UnsupportedTargetError as err:
        if step == "graphed":
            raise ConfigError(f"evaluate.target_step graphed: {err}; use eager (or auto)") from None
        return False, f"evaluate.target_step auto: {err}"
    return True, f"evaluate.target_step {step}"


def runs_graphed(step: TargetStep, model: Any, aux_layer_ids: tuple[int, ...], device_type: str) -> bool:
    """Whether `choose_target_step` takes the graphed step."""
    return choose_target_step(step, model, aux_layer_ids, device_type)[0]


def check_supported(model: Any) -> None:
    """UnsupportedTargetError naming what the graphed step cannot compute for `model`."""
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPES:
        raise UnsupportedTargetError(
            f"{name}: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
        )
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or getattr(inner, "rotary_emb", None) is None:
        raise UnsupportedTargetError(f"{name}: no model.layers and model.rotary_emb to run a graphed step on")
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise UnsupportedTargetError(f"{name}: sliding-window attention (config.sliding_window)")
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        raise UnsupportedTargetError(f"{name}: layers other than full attention (config.layer_types)")
    for i, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is None or not all(hasattr(attention, p) for p in ATTENTION_PARTS):
            raise UnsupportedTargetError(f"{name}: layer {i} has no q/k/v/o projections")
        if not hasattr(layer, "mlp") or not hasattr(layer, "input_layernorm"):
            raise UnsupportedTargetError(f"{name}: layer {i} has no mlp or input_layernorm")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [w] static input
    positions: torch.Tensor  # [w] static input
    logits: torch.Tensor  # [w, V] static output
    aux: torch.Tensor  # [w, A*H] static output


class TargetLayers:
    """The target's forward from its own modules (embedding, norms, projections, MLPs, rotary embedding,
    head) over a KV cache of rows that attend by position: slot j of a row is seen by that row's query at
    position p iff j <= p. What `GraphedTarget` runs for one sequence and `BatchedTarget`
    (targets/batched.py) for many."""

    def __init__(self, model: Any, aux_layer_ids: tuple[int, ...]) -> None:
        check_supported(model)
        self.model = model
        self.layers = list(model.model.layers)
        if not all(0 <= k < len(self.layers) for k in aux_layer_ids):
            raise UnsupportedTargetError(
                f"aux layers {aux_layer_ids} must be inputs of the {len(self.layers)} layers"
            )
        self.aux_layer_ids = aux_layer_ids
        first = self.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.kv_heads = first.k_proj.out_features // self.head_dim
        self.heads = first.q_proj.out_features // self.head_dim
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        rope_module = sys.modules[type(first).__module__]
        self.apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_module.apply_rotary_pos_emb

    def cache(self, rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed keys and values [layers, rows, kv_heads, slots, d] (the slot ids are kept for the masks)."""
        shape = (len(self.layers), rows, self.kv_heads, slots, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.slot_ids = torch.arange(slots, device=self.device)
        return keys, torch.zeros_like(keys)

    def rows_forward(
        self, keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [b, n] appended to the cache rows `keys`, `values` [layers, b, kv_heads, slots, d]
        -> logits [b, n, V] and aux states [b, n, A*H] (each layer's input, as output_hidden_states gives it)."""
        logits, aux, _ = self.rows_states(keys, values, ids, positions)
        return logits, aux

    def rows_states(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rows_forward`, with the final state [b, n, H] beside: after the final norm (`post_norm`, what
        extraction stores of a transformers target), the state lm_head reads. `logits_at` [b]: the logits of
        that one entry a row only ([b, 1, V]; a padded prefill needs each row's last: the whole [b, n, V] is
        gigabytes at a 150k vocabulary)."""
        inner = self.model.model
        h = inner.embed_tokens(ids)  # [b, n, H]
        cos, sin = inner.rotary_emb(h, positions)
        visible = (self.slot_ids[None, None, :] <= positions[:, :, None])[:, None]  # [b, 1, n, slots]
        inputs: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            inputs[index] = h
            x = layer.input_layernorm(h)
            attention = self._attention(
                keys[index], values[index], layer.self_attn, x, cos, sin, positions, visible
            )
            h = h + attention
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        final = inner.norm(h)
        read = (
            final
            if logits_at is None
            else final[torch.arange(len(final), device=final.device), logits_at][:, None]
        )
        return self.model.lm_head(read), torch.cat([inputs[k] for k in self.aux_layer_ids], dim=-1), final

    def _attention(
        self,
        keys: torch.Tensor,  # [b, kv_heads, slots, d]: this layer's cache rows
        values: torch.Tensor,
        attn: Any,
        x: torch.Tensor,  # [b, n, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,  # [b, n]
        visible: torch.Tensor,  # [b, 1, n, slots]
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = attn.q_proj(x).view(b, n, self.heads, self.head_dim)
        k = attn.k_proj(x).view(b, n, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: an RMSNorm per head, before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [b, heads, n, d]
        write_slots(keys, positions, k)
        write_slots(values, positions, v)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=visible,
            scale=float(attn.scaling),
            enable_gqa=self.heads != self.kv_heads,
        )  # [b, heads, n, d]
        return attn.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


def write_slots(cache: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor) -> None:
    """cache [b, heads, slots, d] <- entries [b, heads, n, d] at each row's positions [b, n]."""
    index = positions[:, None, :, None].expand(-1, entries.shape[1], -1, entries.shape[3])
    cache.scatter_(2, index, entries)


class GraphedTarget(TargetLayers):
    """One prompt at a time: `reset`, then `extend(ids)` appends tokens and returns their logits and aux
    states, `keep(n)` rolls the sequence back to its first n tokens. Widths in `graph_widths` run as CUDA
    graphs on a GPU (captured on first use); other widths, and every width on a CPU, run the same code
    eagerly."""

    def __init__(
        self,
        model: Any,
        aux_layer_ids: tuple[int, ...],
        capacity: int,
        graph_widths: Iterable[int] = (),
        graphs: bool | None = None,
    ) -> None:
        super().__init__(model, aux_layer_ids)
        self.capacity = capacity
        self.widest = max([1, *graph_widths])
        # slots past `capacity` are scratch for capture: beyond every real position, so never attended to
        self.keys, self.values = self.cache(1, capacity + self.widest)
        self.use_graphs = self.device.type == "cuda" if graphs is None else graphs
        self.graph_widths = set(graph_widths)
        self.graphs: dict[int, _Graph] = {}
        self.length = 0
        self.check_against_transformers()

    @torch.no_grad()
    def check_against_transformers(self) -> None:
        """UnsupportedTargetError unless the step computes transformers' logits and aux states on a probe,
        prefilled in two appends (so the cache and the positions are exercised too)."""
        vocab = self.model.get_input_embeddings().weight.shape[0]
        tokens = min(PROBE_TOKENS, self.capacity)
        ids = (torch.arange(tokens, device=self.device) * 7919 + 11) % vocab
        out = self.model(input_ids=ids[None], output_hidden_states=True)
        want_aux = torch.cat([out.hidden_states[k][0] for k in self.aux_layer_ids], dim=-1)
        self.reset()
        half = (tokens + 1) // 2
        first = self.extend(ids[:half])
        second = self.extend(ids[half:]) if tokens > half else (first[0][:0], first[1][:0])
        self.reset()
        tolerance = PROBE_TOLERANCE.get(self.dtype, PROBE_TOLERANCE_LOW_PRECISION)
        for what, got, want in (
            ("logits", torch.cat([first[0], second[0]]), out.logits[0]),
            ("aux states", torch.cat([first[1], second[1]]), want_aux),
        ):
            error = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
            if not error <= tolerance:
                raise UnsupportedTargetError(
                    f"{type(self.model).__name__}: the graphed step's {what} differ from transformers' forward "
                    f"by {error:.2g} (relative, more than {tolerance:g}): a layout it does not compute"
                )

    # ---- the sequence -------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0

    def keep(self, length: int) -> None:
        """Roll back to the first `length` tokens (the slots after them are overwritten before they are read)."""
        self.length = min(self.length, length)

    @torch.no_grad()
    def extend(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] and aux states [n, A*H] of `ids` [n] appended at the current length."""
        n = ids.numel()
        if self.length + n > self.capacity:
            raise ValueError(f"{self.length + n} tokens exceed the graphed target's capacity {self.capacity}")
        positions = torch.arange(self.length, self.length + n, device=self.device)
        if self.use_graphs and n in self.graph_widths:
            logits, aux = self._replay(ids, positions)
        else:
            logits, aux = self._forward(ids, positions)
        self.length += n
        return logits, aux

    # ---- the forward ---------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, aux = self.rows_forward(self.keys, self.values, ids[None], positions[None])
        return logits[0], aux[0]

    # ---- CUDA graphs ---------------------------------------------------------------------------------------
    def _replay(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = ids.numel()
        fresh = width not in self.graphs
        graph = self.graphs[width] if not fresh else self._capture(width)
        # a new graph's first replay is checked against the same step run eagerly (both write the same keys
        # and values at the same slots, so running both changes nothing)
        expected = self._forward(ids, positions) if fresh else None
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.graph.replay()
        if expected is not None and not torch.equal(graph.logits, expected[0]):
            error = float((graph.logits.double() - expected[0].double()).abs().max())
            if error > PROBE_TOLERANCE_LOW_PRECISION * float(expected[0].abs().max()):
                raise UnsupportedTargetError(
                    f"the CUDA graph of width {width} computes other logits (by {error:.3g})"
                )
        return graph.logits.clone(), graph.aux.clone()

    def _capture(self, width: int) -> _Graph:
        """Capture the step of `width` tokens, warmed up on a side stream at the scratch slots."""
        ids = torch.zeros(width, dtype=torch.long, device=self.device)
        positions = torch.arange(self.capacity, self.capacity + width, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(ids, positions)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, aux = self._forward(ids, positions)
        captured = _Graph(graph, ids, positions, logits, aux)
        self.graphs[width] = captured
        return captured
