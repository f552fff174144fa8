"""eagle3's architecture table, layer ids and capture hooks against SGLang 0.5.23's own model code, row by row."""

from typing import Any

import pytest

from eagle3_core.engines.sglang_models import MODELS
from tests.conformance.conftest import Probe


@pytest.fixture(scope="module")
def report(sglang_probe: Probe) -> dict[str, Any]:
    result: dict[str, Any] = sglang_probe("probe_capture.py")
    return result


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_the_row_names_the_decoder_logits_processor_and_aux_format_sglangs_code_has(
    report: dict[str, Any], architecture: str
) -> None:
    row, seen = MODELS[architecture], report[architecture]
    assert (seen["decoder"], seen["logits_processor"], seen["aux_output"]) == (
        row.decoder,
        row.logits_processor,
        row.aux_output,
    )


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_the_ids_eagle3_writes_make_sglang_capture_the_trained_layers_or_none_can(
    report: dict[str, Any], architecture: str
) -> None:
    for choice in report[architecture]["captured"]:
        if "refused" in choice:  # every candidate SGLang's rule could turn into the layers misses them
            assert choice["candidates_capture"], choice
            assert all(got != choice["ids"] for got in choice["candidates_capture"].values()), choice
        else:
            assert choice["captured"] == choice["ids"], choice
    refused = [c["ids"] for c in report[architecture]["captured"] if "refused" in c]
    assert refused == (
        [[1, 10, 20]] if MODELS[architecture].layer_id_rule == "plus_one_if_first_is_1" else []
    )


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_the_hooks_turn_sglangs_real_decoder_output_into_aux_then_final_rows(
    report: dict[str, Any], architecture: str
) -> None:
    hooked = report[architecture]["hooked"]
    packed = MODELS[architecture].aux_output == "packed"
    assert hooked["aux_type"] == ("Tensor" if packed else "AuxHiddenStateList")
    assert hooked["passes_final_on"] and hooked["rows_are_aux_then_final"]
    assert hooked["layers_to_capture"] == [2, 12, 21]  # the decoder's own ids: the layers whose input is read
