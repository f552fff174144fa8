"""The managed server's GPU-memory wait against a real driver: `pytest -m gpu tests/gpu/test_sglang_server_gpu.py`.

The stand-in server is a Python process that takes GPU memory through torch (as SGLang's scheduler does),
then answers /health_generate. The default probe (NVML, else nvidia-smi) must see that memory under the
server's PIDs while it runs, and `stop` must wait until the driver reports it free, after SIGTERM and after
SIGKILL. SGLang itself is not run (it is not installed on the GPU host).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from eagle3_core.config import config_from_dict
from eagle3_core.engines.sglang_server import (
    SGLangServer,
    gpu_memory_held_by,
    launch_command,
    nvidia_smi_held,
    nvml_held,
    proc_stat,
)
from eagle3_core.store.layout import StoreLayout
from tests.fakes import free_port

pytestmark = pytest.mark.gpu

GPU_SERVER = r"""
import signal, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
import torch

args = sys.argv[1:]
opt = lambda name, default=None: args[args.index(name) + 1] if name in args else default
if "--fake-ignore-term" in args:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
held = torch.empty(int(float(opt("--fake-gib")) * 2**30), dtype=torch.uint8, device="cuda")
held.fill_(1)
torch.cuda.synchronize()
print("holding", held.numel(), "bytes on", torch.cuda.get_device_name(), flush=True)

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

    def log_message(self, *_):
        pass

HTTPServer((opt("--host"), int(opt("--port"))), Health).serve_forever()
"""


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_stop_waits_until_the_driver_reports_the_servers_memory_free(
    tmp_path: Path, ignores_sigterm: bool
) -> None:
    script = tmp_path / "gpu_server.py"
    script.write_text(GPU_SERVER)
    launcher = [
        sys.executable,
        str(script),
        "--fake-gib",
        "4",
        *(["--fake-ignore-term"] if ignores_sigterm else []),
    ]
    settings = {
        "launcher": launcher,
        "port": free_port(),
        "startup_timeout_s": 180,
        "shutdown_grace_s": 2,
        "gpu_release_timeout_s": 60,
    }
    cfg = config_from_dict({"store": "store", "sglang": settings}, tmp_path)
    polls: list[tuple[float, int]] = []

    def probe(pids: frozenset[int]) -> int:
        held = gpu_memory_held_by(pids)
        polls.append((time.monotonic(), held))
        return held

    server = SGLangServer(cfg.sglang, StoreLayout(cfg.store_root), probe=probe, poll_s=0.1, log=print)
    try:
        server.launch(launch_command(cfg, "/models/none", "extract"))
        pid = server.record.pid  # type: ignore[union-attr]
        nvml, smi = nvml_held({pid}), nvidia_smi_held({pid})
        print(f"while running: NVML {nvml}, nvidia-smi {smi} bytes for pid {pid}")
        assert max(nvml or 0, smi) >= 4 * 2**30, (
            "the driver does not report the server's memory under its PID"
        )
        report = server.stop()
    finally:
        if server.record is not None and proc_stat(server.record.pid) is not None:
            os.kill(server.record.pid, signal.SIGKILL)
    assert report is not None
    print(
        f"stop: {report.signal}, processes gone after {report.exit_s:.2f} s, GPU memory released "
        f"{report.gpu_wait_s:.2f} s later, {len(polls)} probe reads: {[h >> 20 for _, h in polls]} MiB"
    )
    assert report.signal == ("SIGKILL" if ignores_sigterm else "SIGTERM")
    assert polls[-1][1] == 0 and gpu_memory_held_by(report.pids) == 0
