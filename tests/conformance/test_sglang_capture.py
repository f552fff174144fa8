"""eagle3's architecture table, layer ids and capture hooks against SGLang 0.5.23's own model code, row by row: each
row's causal LM is built by SGLang's ModelRunner from a tiny config (families.py `save_table_config`, random
weights) with eagle3's capture hooks in its `forward_hooks`, and run on the CPU (probe_capture.py, one fork of the
session's probe host per row)."""

from collections.abc import Callable
from typing import Any

import pytest

from eagle3_core.engines.sglang_models import MODELS
from tests.conformance.conftest import Probe
from tests.conformance.families import H, save_table_config

Report = Callable[[str], dict[str, Any]]
# SGLang runs GPT-OSS only on attention backends that take its attention sinks, and its CPU attention does not:
# probe_capture.py builds it, never runs it
NOT_RUN = ("GptOssForCausalLM",)


@pytest.fixture(scope="module")
def report(sglang_probe: Probe, tmp_path_factory: pytest.TempPathFactory) -> Report:
    """report(architecture): what probe_capture.py saw of that row, probed once (a failure once too)."""
    root = tmp_path_factory.mktemp("sglang-table")
    seen: dict[str, dict[str, Any] | str] = {}

    def probe(architecture: str) -> dict[str, Any]:
        if architecture not in seen:
            directory = save_table_config(root / architecture, architecture)
            try:
                seen[architecture] = sglang_probe("probe_capture.py", architecture, str(directory))
            except AssertionError as e:
                seen[architecture] = str(e)
        result = seen[architecture]
        if isinstance(result, str):
            pytest.fail(f"probe_capture.py failed for {architecture}: {result}")
        return result

    return probe


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_sglang_hooks_the_rows_decoder_and_logits_processor_and_the_decoder_returns_the_rows_aux_format(
    report: Report, architecture: str
) -> None:
    """The hooks go where SGLang's hook manager matches the row's paths in the built model: the decoder is the
    module the causal LM's own set_eagle3_layers_to_capture marks, the logits processor the model's one
    LogitsProcessor, and the decoder's real prefill returns the row's aux format. GPT-OSS cannot run here (no
    attention sinks in SGLang's CPU attention), so its aux format is still read from its decoder's forward source
    (`AuxHiddenStatePacker(` in it or not)."""
    row, seen = MODELS[architecture], report(architecture)
    assert seen["hooks"] == {"decoder": [row.decoder], "logits": [row.logits_processor]}
    assert seen["decoder"] == [row.decoder]
    assert seen["logits_processors"] == [row.logits_processor]
    assert seen["aux_output"] == row.aux_output
    assert seen["aux_output_from"] == ("source" if architecture in NOT_RUN else "forward")


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_the_ids_eagle3_writes_make_sglang_capture_the_trained_layers_or_none_can(
    report: Report, architecture: str
) -> None:
    for choice in report(architecture)["captured"]:
        if "refused" in choice:  # every candidate SGLang's rule could turn into the layers misses them
            assert choice["candidates_capture"], choice
            assert all(got != choice["ids"] for got in choice["candidates_capture"].values()), choice
        else:
            assert choice["captured"] == choice["ids"], choice
    refused = [c["ids"] for c in report(architecture)["captured"] if "refused" in c]
    assert refused == ([[1, 3, 5]] if MODELS[architecture].layer_id_rule == "plus_one_if_first_is_1" else [])


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_the_hooks_turn_sglangs_real_decoder_output_into_aux_then_final_rows(
    report: Report, architecture: str
) -> None:
    seen = report(architecture)
    hooked = seen["hooked"]
    packed = MODELS[architecture].aux_output == "packed"
    assert hooked["aux_type"] == ("Tensor" if packed else "AuxHiddenStateList")
    assert hooked["passes_final_on"] and hooked["rows_are_aux_then_final"]
    assert hooked["layers_to_capture"] == [2, 12, 21]  # the decoder's own ids: the layers whose input is read
    if architecture not in NOT_RUN:  # a real prefill: every prompt row, [aux of layers 2, 4, 6 | final]
        assert seen["rows"] == {"tokens": 20, "width": 4 * H, "aux_then_final": True}
