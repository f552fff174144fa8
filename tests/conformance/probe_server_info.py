"""Run beside SGLang 0.5.23: for each argv given (JSON), what eagle3's preflight finds wrong in the server
information SGLang would publish for it: `/server_info` is `server_args.resolved_dict()` (plus live state), built
here by SGLang's own `prepare_server_args` from the argv."""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args

from eagle3_core.engines.sglang_models import MODELS
from eagle3_core.targets.sglang import server_problems

aux = json.loads(sys.argv[2])
out = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        info = json.loads(json.dumps(prepare_server_args(argv).resolved_dict(), default=str))
    out.append(server_problems(info, 16384, aux, MODELS["LlamaForCausalLM"]))
print(json.dumps(out))
