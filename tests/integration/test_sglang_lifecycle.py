"""The managed SGLang server's lifecycle, with a real long-running child process standing in for SGLang.

The stand-in (written into tmp) is a Python HTTP server started through `sglang.launcher`, with SGLang's
flags appended; it answers `/health_generate` 503 until its delay has passed, then 200, and starts a child
of its own (as SGLang's launcher starts its scheduler) so that stopping must reach the whole process group.
Options: --fake-delay S, --fake-ignore-term (SIGTERM ignored, inherited by its child), --fake-exit-after S
(prints an error and exits 3 during "loading"), --fake-child-file F (where it writes its child's PID).

SGLang itself is not run here (no CPU build); these tests pin everything around it: process group, PID file,
stale reaping, signal escalation, the GPU-memory wait (with a fake probe), failures with the log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from eagle3_core.config import Eagle3Config, config_from_dict
from eagle3_core.engines.sglang_server import (
    ServerBusyError,
    ServerGpuMemoryNotReleased,
    ServerStartError,
    SGLangServer,
    launch_command,
    proc_stat,
)
from eagle3_core.store.layout import StoreLayout
from tests.fakes import free_port

FAKE_SERVER = r"""
import signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]

def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default

# A process inherits an ignored or blocked SIGTERM from whoever started it (exec keeps both): start from the
# default, as a real server does, unless this fake is told to ignore it.
if "--fake-ignore-term" in args:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
if opt("--fake-child-file"):
    with open(opt("--fake-child-file"), "w") as f:
        f.write(str(child.pid))
print("fake sglang: loading", opt("--model-path"), flush=True)
if opt("--fake-exit-after") is not None:
    time.sleep(float(opt("--fake-exit-after")))
    print("RuntimeError: CUDA out of memory (fake)", file=sys.stderr, flush=True)
    sys.exit(3)
delay, start = float(opt("--fake-delay", "0")), time.monotonic()

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        ready = self.path == "/health_generate" and time.monotonic() - start >= delay
        self.send_response(200 if ready else 503)
        self.end_headers()

    def log_message(self, *_):
        pass

HTTPServer((opt("--host"), int(opt("--port"))), Health).serve_forever()
"""

# Long enough that a loaded 2-core machine still sees a well-behaved server (and its child) exit on SIGTERM:
# two full suite runs saw a group outlive 0.5 s and 3 s there, and get SIGKILL (each file alone passes).
GRACE_S = 10.0


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st.state != "Z"


def wait_dead(pid: int, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


class Fake:
    """Builds configs and servers around the stand-in; remembers every PID to kill at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.script = tmp / "fake_sglang.py"
        self.script.write_text(FAKE_SERVER)
        self.child_file = tmp / "child.pid"
        self.pids: set[int] = set()

    def config(self, *fake_args: str, **sglang: object) -> Eagle3Config:
        launcher = [sys.executable, str(self.script), "--fake-child-file", str(self.child_file), *fake_args]
        settings = {
            "launcher": launcher,
            "port": free_port(),
            "shutdown_grace_s": GRACE_S,
            "gpu_release_timeout_s": 2.0,
            "startup_timeout_s": 10.0,
            **sglang,
        }
        return config_from_dict({"store": "store", "sglang": settings}, self.tmp)

    def server(self, cfg: Eagle3Config, probe: Callable[[frozenset[int]], int] = lambda _: 0) -> SGLangServer:
        return SGLangServer(cfg.sglang, StoreLayout(cfg.store_root), probe=probe, poll_s=0.05)

    def child_pid(self) -> int:
        end = time.monotonic() + 5
        while not (self.child_file.exists() and self.child_file.read_text()):
            assert time.monotonic() < end, "the stand-in never started its child"
            time.sleep(0.02)
        pid = int(self.child_file.read_text())
        self.pids.add(pid)
        return pid

    def track(self, server: SGLangServer) -> None:
        if server.record is not None:
            self.pids.add(server.record.pid)

    def kill_all(self) -> None:
        for pid in self.pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Fake]:
    f = Fake(tmp_path)
    yield f
    f.kill_all()  # every process a test started, by its PID, whatever the test did


def test_launch_waits_for_health_and_stop_ends_the_whole_group(fake: Fake) -> None:
    cfg = fake.config("--fake-delay", "0.6")
    server = fake.server(cfg)
    argv = launch_command(cfg, "/models/target", "extract")
    record = server.start(argv)
    fake.track(server)
    child = fake.child_pid()
    waited = server.wait_healthy()
    assert waited >= 0.5  # it answered 503 while "loading"

    # its own process group (session), with the child in it, not ours
    assert os.getpgid(record.pid) == record.pid == record.pgid != os.getpgid(0)
    assert os.getpgid(child) == record.pgid
    # the PID file: pid, group, start time (/proc field 22), the command, and who owns it
    saved = json.loads(server.pid_file.read_text())
    assert server.pid_file == cfg.store_root / "run" / f"sglang-{socket.gethostname()}.pid"
    assert saved["pid"] == record.pid and saved["pgid"] == record.pgid
    assert saved["start_ticks"] == proc_stat(record.pid).start_ticks  # type: ignore[union-attr]
    assert saved["command"] == argv and saved["owner_pid"] == os.getpid()
    assert "fake sglang: loading /models/target" in server.log_tail()

    report = server.stop()
    assert report is not None and report.signal == "SIGTERM"
    assert {record.pid, child} <= report.pids
    assert not alive(record.pid) and wait_dead(child, 0.1)
    assert not server.pid_file.exists()
    assert server.stop() is None  # idempotent


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace_period(fake: Fake) -> None:
    cfg = fake.config("--fake-ignore-term")
    server = fake.server(cfg)
    with server:
        server.launch(launch_command(cfg, "/models/target", "extract"))
        fake.track(server)
        child = fake.child_pid()
        pid = server.record.pid  # type: ignore[union-attr]
        start = time.monotonic()
        report = server.stop()
    took = time.monotonic() - start
    assert report is not None and report.signal == "SIGKILL"
    assert GRACE_S <= report.exit_s < GRACE_S + 3 and took < GRACE_S + 3
    assert not alive(pid) and not alive(child)


def _crashed_run_server(fake: Fake, cfg: Eagle3Config, *fake_args: str) -> int:
    """A stand-in started by eagle3 as a run starts it, whose run then died: its PID file's owner is a process
    that has exited. Its PID."""
    argv = [*cfg.sglang.launcher, *fake_args, "--host", "127.0.0.1", "--port", str(cfg.sglang.port)]
    server = fake.server(cfg)
    record = server.start(argv)
    fake.pids.add(record.pid)
    owner = subprocess.Popen(["true"])
    owner.wait()
    crashed = record.model_copy(update={"owner_pid": owner.pid, "owner_start_ticks": 1})
    crashed.write(server.pid_file)
    fake.child_pid()  # the stand-in runs: the kernel has filled in its command line and environment
    return record.pid


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_stale_server_left_by_a_crashed_run_is_reaped_at_setup(fake: Fake, ignores_sigterm: bool) -> None:
    cfg = fake.config(*(["--fake-ignore-term"] if ignores_sigterm else []))
    stale = _crashed_run_server(fake, cfg)
    child = fake.child_pid()
    probed: list[frozenset[int]] = []

    def probe(pids: frozenset[int]) -> int:
        probed.append(pids)
        return 0

    server = fake.server(cfg, probe=probe)

    report = server.reap_stale()

    assert report is not None and report.signal == ("SIGKILL" if ignores_sigterm else "SIGTERM")
    assert not alive(stale) and wait_dead(child, 0.1)
    assert not server.pid_file.exists()
    assert probed and {stale, child} <= probed[-1]  # and its GPU memory was asked about
    # the port is free again: a new server starts where the stale one was
    with fake.server(cfg) as fresh:
        fresh.launch(launch_command(cfg, "/models/target", "extract"))
        fake.track(fresh)


def test_a_server_whose_owner_is_alive_is_left_alone(fake: Fake) -> None:
    cfg = fake.config()
    running = _crashed_run_server(fake, cfg)
    record = json.loads(StoreLayout(cfg.store_root).sglang_pid_file(socket.gethostname()).read_text())
    record |= {"owner_pid": os.getpid(), "owner_start_ticks": proc_stat(os.getpid()).start_ticks}  # type: ignore[union-attr]
    server = fake.server(cfg)
    server.pid_file.write_text(json.dumps(record))
    with pytest.raises(ServerBusyError, match="still running"):
        server.reap_stale()
    assert alive(running) and server.pid_file.exists()


def test_a_pid_file_of_a_dead_or_reused_pid_is_removed_and_nothing_is_killed(fake: Fake) -> None:
    cfg = fake.config()
    server = fake.server(cfg)
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = proc_stat(os.getpid())
    assert me is not None
    base = {
        "pgid": 0,
        "hostname": socket.gethostname(),
        "port": 1,
        "command": [],
        "started_at": "",
        "owner_pid": gone.pid,
        "owner_start_ticks": None,
        "log": "",
    }
    server.pid_file.parent.mkdir(parents=True, exist_ok=True)
    # a dead PID; then this very process's PID with another start time (the PID was reused)
    for pid, ticks in ((gone.pid, 1), (os.getpid(), me.start_ticks - 1)):
        server.pid_file.write_text(json.dumps({**base, "pid": pid, "pgid": pid, "start_ticks": ticks}))
        assert server.reap_stale() is None
        assert not server.pid_file.exists()
    server.pid_file.write_text("{torn")
    assert server.reap_stale() is None and not server.pid_file.exists()


@pytest.mark.parametrize("planted", ["without_marker", "group_only", "wrong_marker", "pid_only"])
def test_a_planted_pid_file_never_gets_an_unrelated_process_signalled(fake: Fake, planted: str) -> None:
    """A PID file naming a process eagle3 did not start, with everything about it that /proc tells anyone
    (PID, group, start time, command line) and a dead owner: the file is removed, nothing is signalled."""
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its own group, as a server's
    fake.pids.add(victim.pid)
    owner = subprocess.Popen(["true"])
    owner.wait()
    stat = proc_stat(victim.pid)
    assert stat is not None
    # the PID file as eagle3 wrote it before markers: a live group, a leader with its true start time
    record: dict[str, object] = {
        "pid": victim.pid,
        "pgid": victim.pid,
        "start_ticks": stat.start_ticks,
        "hostname": socket.gethostname(),
        "port": 1,
        "command": ["sleep", "60"],
        "started_at": "2026-01-01T00:00:00+00:00",
        "owner_pid": owner.pid,
        "owner_start_ticks": 1,
        "log": "",
    }
    if planted == "group_only":  # a leader that is gone, and the victim's group as the server's
        record |= {"pid": owner.pid, "start_ticks": 0}
    if planted == "wrong_marker":
        record |= {"marker": "0" * 32}
    cfg = fake.config()
    logged: list[str] = []
    server = SGLangServer(cfg.sglang, StoreLayout(cfg.store_root), probe=lambda _: 0, log=logged.append)
    server.pid_file.parent.mkdir(parents=True, exist_ok=True)
    server.pid_file.write_text(f"{victim.pid}\n" if planted == "pid_only" else json.dumps(record))

    assert server.reap_stale() is None

    time.sleep(0.2)  # a signal, had one been sent, has been delivered
    assert victim.poll() is None, f"{planted}: the unrelated process was killed"
    assert not server.pid_file.exists()
    [line] = logged
    assert "nothing signalled" in line and str(server.pid_file) in line


def test_a_server_whose_leader_died_is_reaped_through_its_marked_child(fake: Fake) -> None:
    """The launcher gone, its child left holding the GPUs: the child carries eagle3's marker, so the group is
    still shown to be the server's, and it is stopped."""
    cfg = fake.config()
    leader = _crashed_run_server(fake, cfg, "--fake-exit-after", "0")
    child = fake.child_pid()
    assert wait_dead(leader)  # exited 3 (a zombie of this test process: not running)
    report = fake.server(cfg).reap_stale()
    assert report is not None and report.signal == "SIGTERM" and child in report.pids
    assert wait_dead(child, 0.1)


def test_stop_waits_until_the_probe_reports_the_gpus_released(fake: Fake) -> None:
    cfg = fake.config()
    calls: list[frozenset[int]] = []

    def probe(pids: frozenset[int]) -> int:
        calls.append(pids)
        return 0 if len(calls) > 4 else 3 << 30  # still held for four polls after the processes died

    server = fake.server(cfg, probe=probe)
    server.launch(launch_command(cfg, "/models/target", "extract"))
    fake.track(server)
    child = fake.child_pid()
    report = server.stop()
    assert report is not None and len(calls) == 5
    assert report.gpu_wait_s >= 4 * 0.05
    assert child in report.pids and all(c == report.pids for c in calls)  # the group's PIDs, the child's too


def test_gpu_memory_never_released_fails_clearly_after_the_timeout(fake: Fake) -> None:
    cfg = fake.config(gpu_release_timeout_s=0.4)
    server = fake.server(cfg, probe=lambda _: 5 << 30)
    server.launch(launch_command(cfg, "/models/target", "extract"))
    fake.track(server)
    pid = server.record.pid  # type: ignore[union-attr]
    start = time.monotonic()
    with pytest.raises(
        ServerGpuMemoryNotReleased,
        match=r"5120 MiB .*0.4 s after they exited \(sglang\.gpu_release_timeout_s\)",
    ):
        server.stop()
    assert 0.4 <= time.monotonic() - start < 3
    assert not alive(pid) and not server.pid_file.exists()  # the processes are gone all the same
    assert server.stop() is None


def test_a_server_that_exits_during_startup_fails_with_its_log_tail(fake: Fake) -> None:
    cfg = fake.config("--fake-exit-after", "0.2")
    server = fake.server(cfg)
    server.start(launch_command(cfg, "/models/target", "extract"))
    fake.track(server)
    child = fake.child_pid()
    with pytest.raises(ServerStartError) as err:
        server.wait_healthy()
    message = str(err.value)
    assert "exited with status 3 before answering /health_generate" in message
    assert "RuntimeError: CUDA out of memory (fake)" in message and str(server.log_file) in message
    # the launcher died, but its child (SGLang's scheduler, say) would hold the GPUs: it was stopped too
    assert wait_dead(child, 0.1) and not server.pid_file.exists()


def test_a_server_that_never_answers_is_stopped_after_the_startup_timeout(fake: Fake) -> None:
    cfg = fake.config("--fake-delay", "600", startup_timeout_s=0.6)
    server = fake.server(cfg)
    server.start(launch_command(cfg, "/models/target", "extract"))
    fake.track(server)
    pid = server.record.pid  # type: ignore[union-attr]
    with pytest.raises(ServerStartError, match=r"did not answer .*/health_generate within 0.6 s"):
        server.wait_healthy()
    assert not alive(pid)


def test_a_taken_port_is_refused_before_anything_starts(fake: Fake) -> None:
    cfg = fake.config()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", cfg.sglang.port))
        listener.listen()
        server = fake.server(cfg)
        with pytest.raises(ServerBusyError, match=f"port {cfg.sglang.port}"):
            server.start(launch_command(cfg, "/models/target", "extract"))
    assert server.record is None and not server.pid_file.exists() and not fake.child_file.exists()


def test_the_dagster_resource_reaps_at_setup_and_stops_at_teardown(fake: Fake) -> None:
    import dagster as dg

    from eagle3_dagster.defs.resources import Eagle3Resource, SGLangServerResource

    cfg = fake.config()
    config_path = fake.tmp / "eagle3.yaml"
    config_path.write_text(json.dumps({"store": "store", "sglang": cfg.sglang.model_dump()}))
    stale = _crashed_run_server(fake, cfg)
    fake.child_pid()
    fake.child_file.unlink()

    resource = SGLangServerResource(eagle3=Eagle3Resource(config_path=str(config_path)))
    with dg.build_resources({"sglang": resource}) as resources:
        assert wait_dead(stale)  # reaped at setup
        url = resources.sglang.launch("/models/target", "extract")
        assert url == f"http://127.0.0.1:{cfg.sglang.port}"
        pid_file = StoreLayout(cfg.store_root).sglang_pid_file(socket.gethostname())
        pid = json.loads(pid_file.read_text())["pid"]
        fake.pids.add(pid)
        child = fake.child_pid()
    assert not alive(pid) and not alive(child) and not pid_file.exists()  # stopped at teardown
