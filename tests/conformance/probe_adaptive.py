"""Run beside SGLang 0.5.23: parse the serving argv given (JSON) with SGLang's own `prepare_server_args`, then read
the adaptive table it names back through SGLang's own `AdaptiveSpeculativeParams`, as its EAGLE worker builds it:
print the speculative fields it resolved and the steps it drafts at each batch size given (JSON)."""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

FIELDS = (
    "model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_adaptive", "speculative_adaptive_config",
)  # fmt: skip

argv, batch_sizes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
printed = io.StringIO()
with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
    args = prepare_server_args(argv)
    params = AdaptiveSpeculativeParams(args.speculative_num_steps, args.speculative_adaptive_config)
print(
    json.dumps(
        {
            "fields": {name: getattr(args, name) for name in FIELDS},
            "steps": {str(b): params.get_steps_for_batch(b) for b in batch_sizes},
            "candidate_steps": params.candidate_steps,
            "said": printed.getvalue().splitlines()[-20:],
        }
    )
)
