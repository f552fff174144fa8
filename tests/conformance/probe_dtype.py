"""Run beside SGLang 0.5.23: the dtype its `--dtype` resolution (srt/configs/model_config.py) gives each config
given (JSON list of [dtype argument, config dict]), beside eagle3's `serving_dtype` for the same."""

import json
import sys

from sglang.srt.configs.model_config import _get_and_verify_dtype

from eagle3_core.engines.sglang_models import serving_dtype

out = []
for argument, config in json.loads(sys.argv[1]):
    theirs = str(_get_and_verify_dtype(config, argument)).removeprefix("torch.")
    out.append([theirs, serving_dtype(argument, config)])
print(json.dumps(out))
