"""Hidden states through eagle3's SGLangEngineBackend, live on a CPU: `python live_extract.py MODEL_DIR
PROMPTS.json OUT.safetensors AUX_IDS`. Run beside SGLang's code (tests/conformance/conftest.py's sglang_env);
the states of prompt i are written as aux.i and last.i, float32, and the engine is shut down."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_core.config import TargetConfig
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.sglang import SGLangEngineBackend


def main(model_dir: str, prompts: str, out: str, aux: str) -> None:
    batch = json.loads(Path(prompts).read_text())
    cfg = TargetConfig(dtype="float32", aux_layer_ids=tuple(int(a) for a in aux.split(",")))
    engine = SGLangEngineBackend(Path(model_dir), cfg, device="cpu", mem_fraction_static=0.5)
    try:
        states = engine.hidden_states(batch, torch.float32)
    finally:
        engine.close()
    tensors: dict[str, torch.Tensor] = {}
    for i, s in enumerate(states):
        if not isinstance(s, HiddenStates):
            raise SystemExit(f"prompt {i}: {s}")
        tensors[f"aux.{i}"], tensors[f"last.{i}"] = s.aux.contiguous(), s.last.contiguous()
    save_file(tensors, out)


if __name__ == "__main__":  # SGLang's scheduler is a spawned process: it imports this file again
    main(*sys.argv[1:])
