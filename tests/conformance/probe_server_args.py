"""Run beside SGLang 0.5.23: parse each argv given (JSON) with SGLang's own `prepare_server_args`, and print the
fields it resolved, the deprecation notices it printed, and the engine-argument names eagle3 reads."""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args

from eagle3_core.targets.sglang import server_arg_fields

FIELDS = (
    "model_path", "tp_size", "mem_fraction_static", "host", "port", "dtype", "disable_radix_cache",
    "chunked_prefill_size", "enable_return_hidden_states", "forward_hooks", "cuda_graph_backend_decode",
    "cuda_graph_backend_prefill", "speculative_algorithm", "speculative_draft_model_path",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "enforce_disable_flashinfer_allreduce_fusion",
)  # fmt: skip

parsed = []
for argv in json.loads(sys.argv[1]):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        args = prepare_server_args(argv)
    parsed.append(
        {
            "fields": {name: getattr(args, name) for name in FIELDS},
            "deprecated": [line for line in printed.getvalue().splitlines() if "deprecated" in line.lower()],
        }
    )
fields = server_arg_fields()
print(json.dumps({"parsed": parsed, "engine_fields": sorted(f for f in fields if f in FIELDS)}))
