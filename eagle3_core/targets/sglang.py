"""Hidden states from SGLang, behind the same seam as the transformers target (`ExtractionTarget`).

Two backends, and the checks every response passes before a row can reach a shard.

What SGLang returns, as read in the released SGLang 0.5.23 (and earlier releases where they differ):

- A `/generate` request (or `Engine.generate`) with `"return_hidden_states": true`, to a server whose
  `return_hidden_states_mode` is full (`--enable-return-hidden-states`), gets `meta_info.hidden_states`: a list
  whose first entry is the prefill's rows, followed by one row per later decode step. The prefill entry is
  the forward's rows for that request, `extend_input_len` of them
  (`srt/managers/scheduler_components/batch_result_processor.py`, `_append_prefill_hidden_states`; before
  0.5.23, `len(req.origin_input_ids)` from an offset that advanced only for requests asking for hidden states,
  so a request without them in the batch shifted the rows of those after it). So `max_new_tokens: 1` returns
  exactly the prompt's rows (SpecForge's capture also runs `max_new_tokens=1`).
- The rows are the state entering `lm_head`, after the final norm: `post_norm` (the logits processor stores
  the `hidden_states` it gets; the architectures whose logits processor gets `hidden_states_before_norm`,
  step3p5, deepseek_v4, mimo_v2 and inkling, are not in engines/sglang_models.py and so are refused).
- A radix-cache hit runs the forward over the uncached suffix only, and a chunked prefill keeps only its
  chunk's rows: the sample gets fewer rows than tokens (sglang #4997). Hence every response's row count is
  checked against the request, and extraction servers run `--disable-radix-cache --chunked-prefill-size -1`.
- A NaN or inf in the states: 0.5.23 answers non-streaming `/generate` through orjson, which writes `null`;
  earlier releases went through FastAPI's JSON encoder, which refuses them, and the whole request failed with
  HTTP 500 (`srt/entrypoints/http_server.py`); the engine hands Python floats. All three are handled: a batch
  answered 5xx is sent again sample by sample, and null, NaN and inf are refused per sample.
- Aux layers are not returned by the stock server (docs/reference.md). `sglang_capture.py` adds them through
  SGLang's `forward_hooks`, with SGLang's own `set_eagle3_layers_to_capture`: each row is then
  [aux0 | aux1 | aux2 | final], 4H wide.

The contract of the three backends:

- `SGLangHttpBackend(url, model_dir, cfg, aux_from_response=True)`: a running server. With
  `aux_from_response=True` (what extraction needs) the server must have been launched with eagle3's capture
  hooks (`capture_launch_args`); its `/server_info` is checked for them, for the same layer ids, and for
  the radix cache and chunked prefill being off, before any sample is sent. With `aux_from_response=False`
  (the stock server) only `final_states` works: `hidden_states` refuses with the reason, never inventing aux
  states. `SGLangManagedBackend(model_dir, cfg)` is the same over a server it starts from eagle3's extraction
  command and stops on `close`.
- `SGLangEngineBackend(model_dir, cfg)`: SGLang's in-process `sglang.Engine` (a GPU, or a CPU), started with the
  flags extraction needs and the capture hooks, its resolved arguments (`Engine.get_server_info`) then checked
  as a server's `/server_info` is; it always returns aux and final states.

Failures: a response whose rows do not match the request (count, echoed token ids, a null/NaN/inf value) is a
`SampleFailure` with its reason, counted and never stored. A wrong row width or a missing `hidden_states` is
the server's configuration, the same for every sample: it raises `SGLangError` and stops the run.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_core.config import Eagle3Config, TargetConfig, without_url_passwords
from eagle3_core.conventions import check_aux_layer_ids, default_aux_layer_ids
from eagle3_core.engines import http
from eagle3_core.engines.sglang_capture import capture_hook_specs, capture_launch_args, hooked_layer_ids
from eagle3_core.engines.sglang_client import SGLangError
from eagle3_core.engines.sglang_models import (
    SGLangModel,
    device_settings,
    resolved_device,
    serving_dtype,
    sglang_model,
)
from eagle3_core.errors import Eagle3Error
from eagle3_core.store.layout import StoreLayout
from eagle3_core.targets.base import HiddenStates, SampleFailure, TargetInfo

__all__ = [
    "SGLangEngineBackend",
    "SGLangError",
    "SGLangHttpBackend",
    "capture_launch_args",
    "echo_problem",
    "finite_problem",
    "row_count_problem",
    "states_from_response",
    "width_problem",
]

NUM_AUX = 3
# One new token: the prefill's entry is then the only one (see the module docstring); greedy, so the token
# generated on the way is the same whatever the server's default sampling.
SAMPLING: dict[str, float | int] = {"max_new_tokens": 1, "temperature": 0.0}
INSTALL_HINT = "pip install 'eagle3[sglang]' on a GPU host (its torch and transformers pins must match it)"
AUX_UNAVAILABLE = (
    "this SGLang server returns only the final hidden state (the stock `--enable-return-hidden-states`); the "
    "three aux layers EAGLE-3 trains on are not reachable through it (docs/reference.md). Launch the server with "
    "eagle3's capture hooks (`{flags}`), or set target.backend: sglang_engine. No aux states are invented"
)


# ---- checks on one response (pure) ---------------------------------------------------------------------------
def row_count_problem(rows: int, tokens: int, cached_tokens: int | None = None) -> str | None:
    """Why `rows` hidden-state rows cannot be the states of a `tokens`-token request; None if they can."""
    if rows == tokens:
        return None
    head = f"sglang returned {rows} hidden-state rows for {tokens} input tokens"
    if rows > tokens:
        return f"{head}: more rows than tokens, so some belong to another request or to generated tokens"
    # reasons stay under the shard's 200-character limit (store.shards.MAX_REASON), the cause first
    if cached_tokens:
        return (
            f"{head}: the radix cache served a cached prefix ({cached_tokens} tokens) without running it; "
            "launch with --disable-radix-cache"
        )
    return (
        f"{head}: part of the prompt was not run (a chunked prefill or the radix cache); "
        "launch with --chunked-prefill-size -1 --disable-radix-cache"
    )


def width_problem(width: int, hidden_size: int, with_aux: bool) -> str | None:
    """Why rows `width` wide are not what was asked (H, or 4H with the aux layers); None if they are."""
    expected = (NUM_AUX + 1) * hidden_size if with_aux else hidden_size
    if width == expected:
        return None
    head = f"sglang returned hidden-state rows {width} wide, expected {expected} (hidden size {hidden_size}"
    head += f", {NUM_AUX} aux layers and the final state)" if with_aux else ", the final state)"
    if width == hidden_size and with_aux:
        return (
            f"{head}: the server returns the final state only; it was not started with eagle3's capture "
            "hooks (`--forward-hooks`, see capture_launch_args), or they are not on yet"
        )
    if width == NUM_AUX * hidden_size:
        return (
            f"{head}: these are SGLang's own EAGLE-3 aux states, which replace the final state when a drafter "
            "is loaded or under --enable-return-aux-hidden-states; extraction needs both, through eagle3's "
            "capture hooks: extract from a server without --speculative-algorithm and without "
            "--enable-return-aux-hidden-states"
        )
    return f"{head}: the server runs another model than target.path"


def finite_problem(states: torch.Tensor) -> str | None:
    """Where the first NaN or inf of `states` [T, W] is, and how many there are; None if all are finite."""
    bad = ~torch.isfinite(states)
    if not bool(bad.any()):
        return None
    row, col = (int(i) for i in bad.nonzero()[0])
    value = float(states[row, col])
    return (
        f"sglang returned {int(bad.sum())} non-finite hidden-state values (first: {value} at row {row}, "
        f"column {col}); the target overflowed on this sample"
    )


def echo_problem(echoed: Sequence[int], sent: Sequence[int]) -> str | None:
    """Token ids the server says it ran, against those sent (they cover the last len(echoed) tokens)."""
    if len(echoed) > len(sent):
        return f"sglang echoed {len(echoed)} input token ids for {len(sent)} sent"
    tail = list(sent[len(sent) - len(echoed) :])
    if list(echoed) == tail:
        return None
    first = next(i for i, (a, b) in enumerate(zip(echoed, tail, strict=True)) if a != b)
    at = len(sent) - len(echoed) + first
    return f"sglang ran other token ids than were sent: position {at} is {echoed[first]}, sent {tail[first]}"


def _null_position(rows: list[Any]) -> tuple[int, int] | None:
    for r, row in enumerate(rows):
        for c, value in enumerate(row):
            if value is None:
                return r, c
    return None


def _rows_tensor(rows: object, hidden_size: int, with_aux: bool) -> torch.Tensor | SampleFailure:
    """The prefill entry of meta_info.hidden_states as float32 [T, W], or why it is not one."""
    if isinstance(rows, torch.Tensor):  # an engine may hand tensors rather than lists
        t = rows.detach().to("cpu", torch.float32)
        t = t.unsqueeze(0) if t.dim() == 1 else t
    else:
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            return SampleFailure(
                f"sglang's meta_info.hidden_states[0] is not a list of rows: {http.clip(rows, 120)}"
            )
        widths = sorted({len(r) for r in rows})
        if len(widths) > 1:
            return SampleFailure(f"sglang returned hidden-state rows of unequal widths {widths[:4]}")
        try:
            t = (
                torch.tensor(rows, dtype=torch.float32)
                if rows
                else torch.empty(0, widths[0] if widths else 0)
            )
        except (TypeError, ValueError):
            at = _null_position(rows)
            if at is None:
                return SampleFailure("sglang returned hidden-state values that are not numbers")
            # orjson writes NaN and inf as null: the value is lost, but it was not a finite number
            return SampleFailure(
                f"sglang returned null for a hidden-state value (row {at[0]}, column {at[1]}): a NaN or inf "
                "as orjson writes them; the target overflowed on this sample"
            )
    if t.dim() != 2:
        return SampleFailure(f"sglang's hidden states have shape {tuple(t.shape)}, not [tokens, width]")
    # a wrong width is the server's configuration, the same for every sample: it stops the run
    if t.shape[0] > 0 and (why := width_problem(int(t.shape[1]), hidden_size, with_aux)):
        raise SGLangError(why)
    return t


def states_from_response(
    response: object, sent: Sequence[int], hidden_size: int, with_aux: bool
) -> torch.Tensor | SampleFailure:
    """The checked rows [len(sent), W] of one `/generate` response (W = 4H with aux, else H), float32.

    SampleFailure when this sample's rows cannot be trusted; SGLangError when no sample's could (not a
    response, no hidden states at all, rows of another width).
    """
    if not isinstance(response, dict):
        raise SGLangError(f"SGLang response is not a JSON object: {http.clip(response)}")
    if "error" in response or response.get("object") == "error":
        raise SGLangError(f"SGLang answered with an error: {http.error_message(response)}")
    meta = response.get("meta_info")
    if not isinstance(meta, dict):
        raise SGLangError(f"SGLang response has no meta_info object: {http.clip(response)}")
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return SampleFailure(f"sglang aborted the request: {finish.get('message', '(no message)')}")
    entries = meta.get("hidden_states")
    if not isinstance(entries, list) or not entries:
        raise SGLangError(
            "SGLang response has no meta_info.hidden_states: start the server with "
            "--enable-return-hidden-states (the request sets return_hidden_states)"
        )
    counted = meta.get("prompt_tokens")
    if isinstance(counted, int) and counted != len(sent):
        return SampleFailure(f"sglang counted {counted} prompt tokens for {len(sent)} input_ids sent")
    echoed = meta.get("input_token_logprobs")  # [[logprob, token_id, text], ...] when logprobs were asked
    if isinstance(echoed, list) and echoed:
        ids = [e[1] for e in echoed if isinstance(e, list | tuple) and len(e) > 1 and isinstance(e[1], int)]
        if len(ids) != len(echoed):
            return SampleFailure(
                "sglang's meta_info.input_token_logprobs are not [logprob, token_id, text] entries"
            )
        if why := echo_problem(ids, sent):
            return SampleFailure(why)
    states = _rows_tensor(entries[0], hidden_size, with_aux)
    if isinstance(states, SampleFailure):
        return states
    cached = meta.get("cached_tokens")
    if why := row_count_problem(int(states.shape[0]), len(sent), cached if isinstance(cached, int) else None):
        return SampleFailure(why)
    if why := finite_problem(states):
        return SampleFailure(why)
    return states


def _split(states: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> HiddenStates:
    """[T, 4H] rows as HiddenStates: aux [T, 3H] in aux_layer_ids order, the final state [T, H]."""
    states = states.to(dtype)
    return HiddenStates(aux=states[:, : NUM_AUX * hidden_size], last=states[:, NUM_AUX * hidden_size :])


# ---- what both backends know of the target -------------------------------------------------------------------
Described = tuple[Any, str, TargetInfo, tuple[str, ...]]  # tokenizer, its fingerprint, info, architectures


def describe_target(model_dir: Path, cfg: TargetConfig, device: str) -> Described:
    """The tokenizer, its fingerprint, the TargetInfo and the architectures of the model SGLang serves, from
    its directory."""
    from transformers import AutoConfig, AutoTokenizer

    from eagle3_core.targets.hf import target_fingerprint, tokenizer_fingerprint

    config: Any = AutoConfig.from_pretrained(model_dir)
    text: Any = getattr(config, "text_config", None) or config  # a multimodal target's language model
    num_layers = int(text.num_hidden_layers)
    aux = (
        check_aux_layer_ids(cfg.aux_layer_ids, num_layers)
        if cfg.aux_layer_ids
        else default_aux_layer_ids(num_layers)
    )
    info = TargetInfo(
        name=str(model_dir),
        fingerprint=target_fingerprint(model_dir),
        num_layers=num_layers,
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        aux_layer_ids=aux,
        final_state_convention="post_norm",  # the state entering lm_head (module docstring)
        dtype=serving_dtype(cfg.dtype, text.to_dict()),
        device=device,
    )
    architectures = tuple(getattr(config, "architectures", None) or ())
    return AutoTokenizer.from_pretrained(model_dir), tokenizer_fingerprint(model_dir), info, architectures


SERVER_INFO_ROUTES = ("/server_info", "/get_server_info")  # 0.5.23's, then the one it deprecated


# The resolved fields of SGLang 0.5.23 that say an all-reduce is, or may be, fused into the next layer's RMSNorm
# (the backend is chosen per GPU at startup). SGLang before sgl-project/sglang#28343 (merged 2026-06-17) then
# captured a fused layer's input before the all-reduce, each rank's partial sum under tensor parallelism; 0.5.23
# completes the sum before a capture reads it (layers/layer_boundary/stage.py), so the refusal guards the older
# SGLang eagle3 accepts (>= 0.5.6)
ALLREDUCE_FUSION_FIELDS = (
    "flashinfer_allreduce_fusion_backend",
    "enable_flashinfer_allreduce_fusion",
    "enable_aiter_allreduce_fusion",
)


def server_problems(
    info: dict[str, Any],
    max_seq_len: int | None,
    aux_layer_ids: list[int] | None,
    model: SGLangModel | None,
) -> list[str]:
    """What in a server's resolved arguments (`/server_info`) would lose or misplace rows, one reason each.

    `aux_layer_ids`: the layers the capture hooks must read (None: final states only, no hooks needed).
    Hidden states come back for every prompt row only under `return_hidden_states_mode` full, which
    `--enable-return-hidden-states` resolves to (`last` returns the last row alone); a release without the
    mode says it with `enable_return_hidden_states`.
    """
    problems = []
    mode = info.get("return_hidden_states_mode")
    if mode == "last" or (mode is None and info.get("enable_return_hidden_states") is False):
        problems.append(
            "it returns no hidden states for every prompt token (launch with --enable-return-hidden-states "
            "or --return-hidden-states-mode full)"
        )
    if info.get("disable_radix_cache") is False:
        problems.append(
            "its radix cache is on: a cached prefix is not run, so its rows go missing "
            "(launch with --disable-radix-cache)"
        )
    chunk = info.get("chunked_prefill_size")
    if isinstance(chunk, int) and chunk > 0 and max_seq_len is not None and chunk < max_seq_len:
        problems.append(
            f"its chunked prefill ({chunk} tokens) splits samples of up to {max_seq_len} tokens and "
            "returns only the last chunk's rows (launch with --chunked-prefill-size -1)"
        )
    if info.get("enable_return_aux_hidden_states") is True:
        problems.append(
            "it runs --enable-return-aux-hidden-states, which returns the aux states in place of the final "
            "state: extraction needs both, through eagle3's capture hooks instead (launch without it)"
        )
    tp = info.get("tp_size")
    fused = [f for f in ALLREDUCE_FUSION_FIELDS if info.get(f) not in (None, False)]
    if info.get("enforce_disable_flashinfer_allreduce_fusion") is True:  # it wins over both flashinfer fields
        fused = [f for f in fused if "flashinfer" not in f]
    if isinstance(tp, int) and tp > 1 and fused:
        problems.append(
            f"it fuses the all-reduce into the next layer's norm ({', '.join(fused)}) at tp {tp}: an SGLang older "
            "than sgl-project/sglang#28343 then reads a layer's input as each rank's partial sum; launch with "
            "--enforce-disable-flashinfer-allreduce-fusion and without --enable-aiter-allreduce-fusion"
        )
    if aux_layer_ids is not None and model is not None:
        hooked = hooked_layer_ids(info.get("forward_hooks"))
        if hooked is None:
            problems.append(
                "it does not run eagle3's capture hooks, so it returns no aux states (launch with "
                f"{shlex.join(capture_launch_args(aux_layer_ids, model))})"
            )
        elif hooked != aux_layer_ids:
            problems.append(
                f"its capture hooks read layers {hooked}, the target's aux layers are {aux_layer_ids} "
                "(target.aux_layer_ids): a drafter trained on them would read the wrong layers"
            )
    return problems


PROBE = (1, 2, 3, 4)  # any ids of the vocabulary: only the width of their rows is looked at


def wait_for_capture(
    generate: Callable[[list[list[int]]], list[Any]], hidden_size: int, who: str, attempts: int = 3
) -> None:
    """Send a probe until the rows come back with the aux states (4H wide); Eagle3Error if they never do.

    The capture hooks turn SGLang's capture on after the decoder's first forward (sglang_capture.py): an
    engine has run none when it starts, a server has run its own warm-up request, unless started without it.
    """
    width = 0
    for _ in range(attempts):
        [response] = generate([list(PROBE)])
        meta = response.get("meta_info") if isinstance(response, dict) else None
        entries = meta.get("hidden_states") if isinstance(meta, dict) else None
        rows = entries[0] if isinstance(entries, list) and entries else None
        if isinstance(rows, torch.Tensor):  # an engine may hand tensors rather than lists
            width = int(rows.shape[-1])
        else:
            width = len(rows[0]) if isinstance(rows, list) and rows and isinstance(rows[0], list) else 0
        if width == (NUM_AUX + 1) * hidden_size:
            return
    raise Eagle3Error(
        f"{who} still returns hidden-state rows {width} wide after {attempts} requests, not "
        f"{(NUM_AUX + 1) * hidden_size}: eagle3's capture hooks did not take effect on this model"
    )


# ---- the HTTP backend ----------------------------------------------------------------------------------------
class SGLangHttpBackend:
    """Hidden states from a running SGLang server's `/generate`, one request per batch (`input_ids` lists).

    Nothing is cached between batches and the server's lifecycle is not ours (`close` stops nothing).
    `max_seq_len`: the longest sample extraction sends, checked against the server's chunked-prefill size.
    """

    quantizes_on_device = False  # the states arrive on the host: an FP8 shard quantises them in its writer

    def __init__(
        self,
        url: str,
        model_dir: Path,
        cfg: TargetConfig,
        *,
        aux_from_response: bool = True,
        max_seq_len: int | None = None,
        timeout_s: float = 600.0,
        echo_token_ids: bool = False,
        preflight: bool = True,
        described: Described | None = None,
    ) -> None:
        """`described`: `describe_target`'s result when the caller has it already (`SGLangManagedBackend`
        needs the aux layers before the server it connects to exists)."""
        self.url = url.rstrip("/")
        self.shown_url = without_url_passwords(self.url)  # in messages and logs; the requests go to `url`
        self.aux_from_response = aux_from_response
        self.timeout_s = timeout_s
        # SGLang echoes the ids it ran only with input logprobs, which cost a log-softmax over the vocabulary
        # at every prompt position: off by default, the row count and prompt_tokens are checked regardless
        self.echo_token_ids = echo_token_ids
        self.tokenizer, self.tokenizer_fingerprint, self.info, architectures = described or describe_target(
            model_dir, cfg, device=f"sglang {self.shown_url}"
        )
        # the capture hooks' module paths depend on the architecture: known, or refused (a stock server that
        # gives final states only needs neither)
        self.architectures, self.where = architectures, str(model_dir / "config.json")
        self.capture_model = sglang_model(architectures, self.where) if aux_from_response else None
        if preflight:
            self.check_server(max_seq_len)
            if aux_from_response:
                wait_for_capture(self._generate, self.hidden_size, f"the SGLang server at {self.shown_url}")

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    def check_server(self, max_seq_len: int | None = None) -> dict[str, Any] | None:
        """Refuse a server whose settings would lose or misplace rows, before any sample is sent.

        Reads `/server_info` (SGLang's resolved server arguments; `/get_server_info` on releases before it,
        where it is now deprecated); None when the server has neither, in which case only the per-response
        checks remain.
        """
        info = None
        for route in SERVER_INFO_ROUTES:
            info = http.request_json(
                "GET",
                self.url + route,
                None,
                min(self.timeout_s, 60.0),
                who="SGLang",
                error=SGLangError,
                missing=True,
            )
            if info is not None:
                break
        if not isinstance(info, dict):
            return None
        wanted = list(self.info.aux_layer_ids) if self.aux_from_response else None
        problems = server_problems(info, max_seq_len, wanted, self.capture_model)
        if problems:
            raise SGLangError(
                f"the SGLang server at {self.shown_url} cannot serve extraction: " + "; ".join(problems)
            )
        return info

    def hidden_states(
        self, batch: Sequence[Sequence[int]], dtype: torch.dtype | None = None
    ) -> list[HiddenStates | SampleFailure]:
        if not self.aux_from_response:
            raise Eagle3Error(
                AUX_UNAVAILABLE.format(
                    flags=shlex.join(
                        capture_launch_args(
                            self.info.aux_layer_ids, sglang_model(self.architectures, self.where)
                        )
                    )
                )
            )
        dtype = dtype or torch.float32
        return [
            s if isinstance(s, SampleFailure) else _split(s, self.hidden_size, dtype)
            for s in self._states(batch)
        ]

    def final_states(
        self, batch: Sequence[Sequence[int]], dtype: torch.dtype | None = None
    ) -> list[torch.Tensor | SampleFailure]:
        """The final (post-norm) state [T, H] of each sequence, checked like the full rows."""
        dtype = dtype or torch.float32
        return [
            s if isinstance(s, SampleFailure) else s[:, -self.hidden_size :].to(dtype)
            for s in self._states(batch)
        ]

    def close(self, timeout_s: float = 60.0) -> float:
        return 0.0  # the server belongs to whoever started it (sglang_server.SGLangServer for managed ones)

    # -- requests
    def _states(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor | SampleFailure]:
        seqs = [list(s) for s in batch]
        try:
            responses = self._generate(seqs)
        except SGLangError as err:
            if err.status < 500:
                raise
            return self._one_by_one(seqs, err)
        return [
            states_from_response(r, s, self.hidden_size, self.aux_from_response)
            for r, s in zip(responses, seqs, strict=True)
        ]

    def _one_by_one(
        self, seqs: list[list[int]], batch_error: SGLangError
    ) -> list[torch.Tensor | SampleFailure]:
        """A batch answered 5xx: each sample alone, so one unencodable sample does not sink the others."""
        out: list[torch.Tensor | SampleFailure] = []
        errors: list[SGLangError] = []
        for s in seqs:
            try:
                [response] = self._generate([s])
            except SGLangError as err:
                if err.status < 500:
                    raise
                errors.append(err)
                out.append(
                    SampleFailure(
                        f"sglang answered HTTP {err.status} for this sample, alone too: its JSON encoder "
                        "fails that way on a NaN or inf hidden state; the target likely overflowed on it"
                    )
                )
                continue
            out.append(states_from_response(response, s, self.hidden_size, self.aux_from_response))
        if len(seqs) > 1 and len(errors) == len(seqs):
            # every sample fails alone as well: the server is broken, not the data
            raise SGLangError(
                f"SGLang failed on every sample of the batch, alone too: {batch_error}"
            ) from batch_error
        return out

    def _generate(self, seqs: list[list[int]]) -> list[object]:
        body: dict[str, Any] = {
            "input_ids": seqs,  # a list of lists is a batch: the answer is a list, in request order
            "sampling_params": dict(SAMPLING),
            "return_hidden_states": True,
        }
        if self.echo_token_ids:
            body.update(return_logprob=True, logprob_start_len=0)
        answer = http.request_json(
            "POST", self.url + "/generate", body, self.timeout_s, who="SGLang", error=SGLangError
        )
        if isinstance(answer, dict):
            raise SGLangError(
                f"SGLang answered a batch of {len(seqs)} with one object: "
                + (
                    http.error_message(answer)
                    if "error" in answer or "message" in answer
                    else http.clip(answer)
                )
            )
        if not isinstance(answer, list) or len(answer) != len(seqs):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise SGLangError(f"SGLang answered a batch of {len(seqs)} requests with {got} responses")
        return answer


# ---- the in-process engine -----------------------------------------------------------------------------------
class SGLangManagedBackend(SGLangHttpBackend):
    """`SGLangHttpBackend` over a server it starts itself (`target.backend: sglang_server`): SGLang's
    `launch_server` from eagle3's extraction command (`engines/sglang_server.launch_command`, capture hooks for
    the target's aux layers), after reaping a server a crashed run left on this host (its PID file in the
    store); `close` stops it and waits until its GPU memory is back."""

    def __init__(self, model_dir: Path, cfg: Eagle3Config, *, log: Callable[[str], None] = print) -> None:
        from eagle3_core.engines.sglang_server import SGLangServer, launch_command

        self.server = SGLangServer(cfg.sglang, StoreLayout(cfg.store_root), log=log)
        described = describe_target(model_dir, cfg.target, device=f"sglang {self.server.url}")
        self.server.reap_stale()
        try:
            argv = launch_command(cfg, model_dir, "extract", aux_layer_ids=described[2].aux_layer_ids)
            url = self.server.launch(argv)
            super().__init__(
                url, model_dir, cfg.target, max_seq_len=cfg.tokenize.max_seq_len, described=described
            )
        except BaseException:
            self.server.stop()
            raise

    def close(self, timeout_s: float = 60.0) -> float:
        report = self.server.stop()
        return report.gpu_wait_s if report is not None else 0.0


class SGLangEngineBackend:
    """Hidden states from `sglang.Engine` started in this process (its scheduler runs in child processes).

    On any device SGLang runs on (`engine_device`): a GPU, or a CPU with its torch_native attention. The engine
    runs the flags extraction needs (docs/reference.md, "Hidden states from SGLang"): hidden states on, radix
    cache off, no CUDA graphs, no chunked prefill; plus eagle3's capture hooks (`sglang_capture.py`), which turn
    on SGLang's own `set_eagle3_layers_to_capture` in the engine's process.
    """

    quantizes_on_device = False  # the states arrive on the host: an FP8 shard quantises them in its writer

    def __init__(
        self,
        model_dir: Path,
        cfg: TargetConfig,
        *,
        tp_size: int = 1,
        mem_fraction_static: float | None = None,
        device: str = "auto",
        max_total_tokens: int | None = None,
        engine_args: dict[str, Any] | None = None,
        max_seq_len: int | None = None,
    ) -> None:
        """`engine_args`: more `sglang.Engine` arguments, over eagle3's (the engine is refused if they undo one
        extraction needs); `max_seq_len`: the longest sample extraction sends, checked against the engine's
        chunked-prefill size as the HTTP backend checks a server's."""
        try:
            import sglang
        except ImportError as e:
            raise Eagle3Error(
                f"target.backend 'sglang_engine' needs SGLang, which is not installed: {INSTALL_HINT}"
            ) from e
        self.device = engine_device(device)
        self.tokenizer, self.tokenizer_fingerprint, self.info, architectures = describe_target(
            model_dir, cfg, device=f"sglang engine (tp {tp_size})"
        )
        self.capture_model = capture_model = sglang_model(architectures, str(model_dir / "config.json"))
        fields = server_arg_fields()
        if "forward_hooks" not in fields:
            raise Eagle3Error(
                f"SGLang {getattr(sglang, '__version__', '?')} has no `forward_hooks` engine argument (added by "
                "sgl-project/sglang PR #13217), through which eagle3 reads the aux layers; install a newer "
                "SGLang"
            )
        args: dict[str, Any] = {
            "model_path": str(model_dir),
            "tp_size": tp_size,
            "enable_return_hidden_states": True,
            "disable_radix_cache": True,  # a cached prefix is not run: its rows would go missing
            "chunked_prefill_size": -1,  # one forward per prompt: a chunk keeps only its own rows
            "skip_tokenizer_init": True,  # ids in, ids out: the text is never wanted
            "forward_hooks": capture_hook_specs(self.info.aux_layer_ids, capture_model),
            "random_seed": 0,
        }
        if cfg.dtype != "auto":
            args["dtype"] = cfg.dtype
        if mem_fraction_static is not None:
            args["mem_fraction_static"] = mem_fraction_static
        args.update(device_settings(self.device, max_total_tokens))
        if tp_size > 1 and "enforce_disable_flashinfer_allreduce_fusion" in fields:
            args["enforce_disable_flashinfer_allreduce_fusion"] = True  # see ALLREDUCE_FUSION_FIELDS
        # toggling return_hidden_states recaptures graphs, and prefill needs none: no CUDA graphs, spelled per
        # phase from 0.5.23 on (its disable_cuda_graph is deprecated)
        if "cuda_graph_backend_decode" in fields:
            args["cuda_graph_backend_decode"] = args["cuda_graph_backend_prefill"] = "disabled"
        else:
            args["disable_cuda_graph"] = True
        if "disable_piecewise_cuda_graph" in fields:
            # a compiled prefill graph would not run the Python hooks on every forward
            args["disable_piecewise_cuda_graph"] = True
        args.update(engine_args or {})
        gpus = min(tp_size, torch.cuda.device_count()) if self.device == "cuda" else 0
        self._devices = list(range(gpus))
        self._free_before = {d: torch.cuda.mem_get_info(d)[0] for d in self._devices}
        self._engine: Any = sglang.Engine(**args)
        try:
            self.server_info = self.check_engine(max_seq_len)
            self._wait_for_capture()
        except BaseException:
            self._engine.shutdown()
            raise

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    def check_engine(self, max_seq_len: int | None = None) -> dict[str, Any]:
        """Refuse an engine whose settings would lose or misplace rows, before any sample is sent: the HTTP
        backend's preflight (`server_problems`) on what `Engine.get_server_info` returns, the resolved server
        arguments `/server_info` serves. What eagle3 asks for is checked as SGLang resolved it (an `engine_args`
        entry, or an SGLang release, may resolve it otherwise)."""
        info: dict[str, Any] = self._engine.get_server_info()
        problems = server_problems(info, max_seq_len, list(self.info.aux_layer_ids), self.capture_model)
        if problems:
            raise SGLangError("the SGLang engine cannot serve extraction: " + "; ".join(problems))
        return info

    def _wait_for_capture(self) -> None:
        wait_for_capture(self._generate, self.hidden_size, "the SGLang engine")

    def _generate(self, seqs: list[list[int]]) -> list[Any]:
        out = self._engine.generate(input_ids=seqs, sampling_params=dict(SAMPLING), return_hidden_states=True)
        return list(out) if isinstance(out, list) else [out]

    def hidden_states(
        self, batch: Sequence[Sequence[int]], dtype: torch.dtype | None = None
    ) -> list[HiddenStates | SampleFailure]:
        seqs = [list(s) for s in batch]
        dtype = dtype or torch.float32
        out: list[HiddenStates | SampleFailure] = []
        for response, seq in zip(self._generate(seqs), seqs, strict=True):
            states = states_from_response(response, seq, self.hidden_size, with_aux=True)
            out.append(
                states if isinstance(states, SampleFailure) else _split(states, self.hidden_size, dtype)
            )
        return out

    def close(self, timeout_s: float = 60.0) -> float:
        """Shut the engine down and wait until its GPUs' memory is back (it is not, the instant it exits)."""
        self._engine.shutdown()
        start = time.monotonic()
        if not self._devices:  # on a CPU: the scheduler's memory goes with its processes
            return 0.0
        slack = 512 * 2**20  # our own CUDA context and the allocator's rounding
        while True:
            short = {d: self._free_before[d] - torch.cuda.mem_get_info(d)[0] for d in self._devices}
            if all(v <= slack for v in short.values()):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                held = max(short.values()) / 2**30
                raise Eagle3Error(
                    f"the SGLang engine's GPU memory was not given back {timeout_s:.0f} s after shutdown "
                    f"({held:.1f} GiB still missing on a device)"
                )
            time.sleep(0.5)


def engine_device(device: str) -> str:
    """target.device for SGLang (`resolved_device`); a device SGLang does not list, or cuda without one, is
    refused in one line."""
    from sglang.srt.configs.device_config import SUPPORTED_DEVICES

    chosen = resolved_device(device)
    if chosen not in SUPPORTED_DEVICES:
        raise Eagle3Error(
            f"target.device {device!r}: SGLang runs on {', '.join(SUPPORTED_DEVICES)}, not {chosen!r}"
        )
    if chosen == "cuda" and not torch.cuda.is_available():
        raise Eagle3Error("target.device is cuda for the SGLang engine, and no CUDA device is visible")
    return chosen


def server_arg_fields() -> set[str]:
    """The engine arguments SGLang accepts: fields of `ServerArgs`, a msgspec Struct since 0.5.23 (a dataclass
    before; `dataclasses.fields` raises TypeError on a Struct)."""
    from sglang.srt.server_args import ServerArgs

    if dataclasses.is_dataclass(ServerArgs):
        return {f.name for f in dataclasses.fields(ServerArgs)}
    import msgspec

    return {f.name for f in msgspec.structs.fields(ServerArgs)}
