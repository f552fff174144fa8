"""Hidden states through eagle3's SGLangEngineBackend, live on a CPU: `python live_extract.py PROMPTS.json AUX_IDS
OUT_DIR MODEL_DIR[@tp2]...`. Run beside SGLang's code (tests/conformance/conftest.py's sglang_env); one engine per
model, one after the other in this process (SGLang is imported once). PROMPTS.json is `{"batch": [...], "after":
[...]}`: the batch is extracted in one call, then, once it has completed, the `after` prompts in a second call
(a prompt there that extends one of the batch would have its prefix served from SGLang's radix cache, were it
on). The states of batch prompt i are written to OUT_DIR/<name>.safetensors as aux.i and last.i, those of `after`
prompt j as aux.after.j and last.after.j, float32 (<name>: the model directory's name, `-tp2` added at tp 2); the
engine's resolved arguments that extraction depends on (RESOLVED, as eagle3's backend read them from
`Engine.get_server_info`) to OUT_DIR/<name>.json.

One stand-in, for a kernel choice and not for eagle3's code: SGLang 0.5.23's DeepSeek attention dispatch has no
entry for the torch_native backend and falls back to triton's, whose MHA prefill cannot read the MLA latent
cache; here torch_native takes the absorbed MLA path, the one SGLang's GPU backends take for these shapes. It is
registered at import, so that SGLang's scheduler (a spawned process, which imports this file again as
`__mp_main__`) has it too."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

from eagle3_core.config import TargetConfig
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.sglang import SGLangEngineBackend

AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)

RESOLVED = (
    "tp_size",
    "disable_radix_cache",
    "chunked_prefill_size",
    "enforce_disable_flashinfer_allreduce_fusion",
)


def extract(
    model_dir: Path, prompts: dict[str, list[list[int]]], aux: tuple[int, int, int], out: Path, tp: int = 1
) -> None:
    cfg = TargetConfig(dtype="float32", aux_layer_ids=aux)
    # a multimodal wrapper's text model alone (Kimi-K2.5): the test directory has no image processor to load
    [architecture] = json.loads((model_dir / "config.json").read_text())["architectures"]
    text_only = {"enable_multimodal": False} if architecture.endswith("ForConditionalGeneration") else {}
    if tp > 1:  # SGLang on a CPU runs one rank per NUMA node unless told which cores each rank takes
        cores = os.cpu_count() or 1
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % cores) for rank in range(tp))
    longest = max(len(p) for p in [*prompts["batch"], *prompts["after"]])
    engine = SGLangEngineBackend(
        model_dir, cfg, device="cpu", tp_size=tp, mem_fraction_static=0.5, max_total_tokens=4096,
        engine_args=text_only, max_seq_len=longest,
    )  # fmt: skip
    try:
        states = engine.hidden_states(prompts["batch"], torch.float32)
        after = engine.hidden_states(prompts["after"], torch.float32)  # the batch has completed
        resolved = {field: engine.server_info.get(field) for field in RESOLVED}
    finally:
        engine.close()
    tensors: dict[str, torch.Tensor] = {}
    for key, results in (("", states), ("after.", after)):
        for i, s in enumerate(results):
            if not isinstance(s, HiddenStates):
                raise SystemExit(f"{model_dir.name}, {key}prompt {i}: {s}")
            tensors[f"aux.{key}{i}"], tensors[f"last.{key}{i}"] = s.aux.contiguous(), s.last.contiguous()
    name = f"{model_dir.name}{f'-tp{tp}' if tp > 1 else ''}"
    save_file(tensors, str(out / f"{name}.safetensors"))
    (out / f"{name}.json").write_text(json.dumps(resolved))


def main(prompts: str, aux: str, out: str, *models: str) -> None:
    """`models`: directories, each extracted at tp 1; `DIR@tp2` extracts DIR at tensor-parallel size 2."""
    asked = json.loads(Path(prompts).read_text())
    a, b, c = (int(x) for x in aux.split(","))
    for model in models:
        model_dir, _, tp = model.partition("@tp")
        print(f"extracting through sglang.Engine: {model}", flush=True)
        extract(Path(model_dir), asked, (a, b, c), Path(out), int(tp or 1))


if __name__ == "__main__":  # SGLang's scheduler is a spawned process: it imports this file again
    main(*sys.argv[1:])
