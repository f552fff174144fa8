"""The per-batch-size arguments `eagle3 serve-command` prints for a promoted drafter with a serving
recommendation, read by SGLang 0.5.23's own code: `prepare_server_args` parses the serving line as printed, and
SGLang's `AdaptiveSpeculativeParams` (what its EAGLE worker builds from `--speculative-adaptive-config`) gives
each batch size the K the recommendation chose, as written."""

import json
import shlex
from pathlib import Path

from eagle3_core.config import load_config
from eagle3_core.evaluate.serving_k import serving_file
from eagle3_core.steps.evaluation import promote_step
from eagle3_core.steps.serving import serve_commands
from eagle3_core.store.layout import StoreLayout
from tests.conformance.conftest import Probe
from tests.conftest import write_config
from tests.records import evaluated_run, serving_recommendation


def test_the_adaptive_serving_line_parses_in_sglang_and_reads_back_as_written(
    tmp_path: Path, sglang_probe: Probe
) -> None:
    config = write_config(tmp_path, "store: store\nevaluate: {ks: [1, 3], gate_k: 1}\n")
    layout = StoreLayout(tmp_path / "store")
    evaluated_run(layout, "r1")
    promote_step(load_config(config))
    recommendation = serving_recommendation()  # K 3 at batch 1, 1 at 16, 0 at 64
    recommendation.write(serving_file(layout.export_eval("r1"), "sglang"))
    commands = serve_commands(load_config(config))
    argv = shlex.split(commands["sglang"])
    server_argv = argv[argv.index("--model-path") :]  # what launch_server's parser reads

    # each measured batch size, and the sizes between them: SGLang takes a batch to the largest key at or below it
    batches = [1, 2, 15, 16, 17, 63, 64, 65, 512]
    got = sglang_probe("probe_adaptive.py", json.dumps(server_argv), json.dumps(batches))
    fields = got["fields"]
    assert fields["speculative_algorithm"] == "EAGLE3" and fields["model_path"] == "org/target-8l"
    assert fields["speculative_draft_model_path"] == str(layout.drafter_current_link / "sglang")
    assert fields["speculative_adaptive"] is True, got["said"]  # not turned off by SGLang's own checks
    assert fields["speculative_adaptive_config"] == commands["sglang_adaptive_config"]
    assert Path(fields["speculative_adaptive_config"]).parent == layout.export_eval("r1")
    # the largest K of the table (gate_k is 1 here): SGLang requires it to be one of the table's steps
    assert (fields["speculative_num_steps"], fields["speculative_eagle_topk"]) == (3, 1)
    assert fields["speculative_num_draft_tokens"] == 4
    assert got["candidate_steps"] == [0, 1, 3]
    written = recommendation.best_k()
    assert written == {1: 3, 16: 1, 64: 0}
    assert got["steps"] == {"1": 3, "2": 3, "15": 3, "16": 1, "17": 1, "63": 1, "64": 0, "65": 0, "512": 0}
