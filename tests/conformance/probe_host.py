"""Run beside SGLang 0.5.23: import SGLang's modules once, then run each probe script asked for, in a fork of
this process, so that every probe starts from the same freshly imported state without importing SGLang again.

One request a line on stdin, a JSON list `[script, *args]`; one answer a line on this process's stdout as it
was at start, `{"returncode": ..., "stdout": ..., "stderr": ...}`: what the script, run as `python script args`
would be, exited with and printed. Anything this process prints itself goes to its stderr.
"""

import json
import os
import runpy
import sys
import tempfile
import traceback

answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # a stray print of an import must not break the protocol

# What the probes import before building anything (the slow part of a probe's start); the model modules they
# load by name are left to them: llama_eagle3 needs the model-parallel groups the probe builds first.
# sglang.benchmark.one_batch (its ModelRunner, the engine's helpers) imports no model module.
import sglang.benchmark.one_batch  # noqa: E402
import sglang.srt.configs.model_config  # noqa: E402
import sglang.srt.distributed.parallel_state  # noqa: E402
import sglang.srt.layers.aux_hidden_states  # noqa: E402
import sglang.srt.layers.logits_processor  # noqa: E402
import sglang.srt.runtime_context  # noqa: E402
import sglang.srt.server_args  # noqa: E402, F401


def run_in_a_fork(script: str, args: list[str]) -> dict[str, object]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the probe, as `python script args` runs it
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            code = 0
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return {
            "returncode": os.waitstatus_to_exitcode(status),
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
        }


for line in sys.stdin:
    script, *args = json.loads(line)
    answers.write(json.dumps(run_in_a_fork(script, args)) + "\n")
    answers.flush()
