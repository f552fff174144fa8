"""The SGLang server eagle3 manages: its launch command (extraction or serving), and its lifecycle.

Why a lifecycle of our own (docs/orchestration.md, the GPU hand-off): an extraction server held 92 GB per GPU
and had to be stopped by hand before training could start, and Dagster runs a resource's teardown, but not
after SIGKILL. So:

- the server runs in its own process group (`start_new_session`): SGLang's scheduler and detokenizer are
  child processes of the launcher, and one signal to the group reaches them all; a Ctrl-C meant for the run
  does not reach the server half-way through its own shutdown;
- a PID file in the store (`run/sglang-<host>.pid`) records the group, what identifies its leader (start
  time, command line, and a random marker set in its environment: procs.StartedProcess) and the run process
  that started it; the next setup on this host reaps a server whose owner is gone (a crashed run), and
  refuses to touch one whose owner is alive. A PID file whose process cannot be shown to be the server eagle3
  started (reused PID, another command, no marker: an old or planted file) is removed, and nothing signalled;
- `stop` sends SIGTERM to the group, SIGKILL after `shutdown_grace_s`, waits until no process of the group is
  left, then waits until the GPU driver stops reporting memory held by those processes (docs/reference.md, "The managed server's GPU memory": a
  killed server's memory is not free the instant it dies), or fails the run saying how much is still held.

SGLang itself is never imported: it is started as `python -m sglang.launch_server ...` in the environment
`sglang.launcher` names (eagle3[sglang], whose pins must match the GPU host). Processes are found through
/proc, so the lifecycle is Linux-only, as SGLang is.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Literal, NoReturn

from eagle3_core.config import Eagle3Config, SGLangServerConfig
from eagle3_core.engines import http
from eagle3_core.engines.sglang_models import (
    device_settings,
    read_architectures,
    resolved_device,
    sglang_model,
)
from eagle3_core.errors import ConfigError, Eagle3Error, RecordError
from eagle3_core.procs import (
    ProcStat,
    StartedProcess,
    marked_environment,
    new_marker,
    proc_has_marker,
    proc_stat,
)
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import ServerRecord

Purpose = Literal["extract", "serve"]
Log = Callable[[str], None]
GpuProbe = Callable[[frozenset[int]], int]  # bytes of GPU memory the driver reports for these PIDs

HEALTH_PATH = (
    "/health_generate"  # answers 200 only once the server has generated a token, not when it listens
)
KILL_WAIT_S = 30.0  # after SIGKILL only a process stuck in the kernel survives; waiting longer would not help

# Extraction reads hidden states off the forward pass (docs/reference.md, "Hidden states from SGLang"):
EXTRACT_FLAGS = (
    # a prefix-cache hit skips the forward pass over the cached tokens, so their rows would go missing (sglang #4997)
    "--disable-radix-cache",
    # returning hidden states recaptures CUDA graphs when toggled; extraction is prefill, which graphs do not
    # speed. SGLang 0.5.23 spells it per phase (its --disable-cuda-graph is deprecated)
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
    # one forward per prompt: chunked prefill would split a sample over several forwards
    "--chunked-prefill-size",
    "-1",
    "--enable-return-hidden-states",
)


class SGLangServerError(Eagle3Error):
    """The managed SGLang server could not be started, did not become healthy, or would not stop."""


class ServerStartError(SGLangServerError):
    """The server exited, or did not answer its health check in time; the message ends with its log's tail."""


class ServerBusyError(SGLangServerError):
    """The port is taken, or this host's server belongs to another run that is still alive."""


class ServerGpuMemoryNotReleased(SGLangServerError):
    """The server's processes are gone but the driver still reports GPU memory held by them.

    The same failure as targets.gpu_memory.GpuMemoryNotReleased, for another process; not a subclass of it
    because that module imports torch, and managing a subprocess needs none.
    """


# ---- the command ---------------------------------------------------------------------------------------------
def architectures_of(model_path: str | Path) -> tuple[str, ...]:
    """The `architectures` of a target directory's config.json; ConfigError for a path not on this machine."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"{model_path}: no config.json here to read the target's architecture from, which the capture "
            "hooks' module paths depend on; pass the architectures"
        )
    return read_architectures(config, ConfigError)


def launch_command(
    cfg: Eagle3Config,
    model_path: str | Path,
    purpose: Purpose,
    drafter_dir: str | Path | None = None,
    k: int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    architectures: Sequence[str] = (),
) -> list[str]:
    """argv of an SGLang server over `model_path`, for hidden-state extraction or for serving a drafter.

    An extraction server given `aux_layer_ids` also loads eagle3's capture hooks (engines/sglang_capture.py),
    so `/generate` returns the three aux states beside the final one; without them it returns the final
    state only. The hooks' module paths follow the target's `architectures` (engines/sglang_models.py), read
    from `model_path`'s config.json when not given.

    On a CPU (target.device cpu, or auto where no CUDA device is visible here) the extraction server gets
    `--device cpu`, the torch_native attention and a KV size (`device_settings`). A drafter is not served on a
    CPU: SGLang 0.5.23 has no draft attention backend there without Intel AMX, so `serve` refuses device cpu.

    `serve` runs EAGLE-3 chain drafting of `k` tokens (default `evaluate.gate_k`, the K the promotion gate
    measured): topk 1, so the verify step holds the K drafts plus the committed token, K + 1.
    """
    s = cfg.sglang
    argv = [
        *s.launcher,
        "--model-path",
        str(model_path),
        "--tp-size",
        str(s.tp_size),
        "--mem-fraction-static",
        str(s.mem_fraction_static),
        "--host",
        s.host,
        "--port",
        str(s.port),
    ]
    if cfg.target.dtype != "auto":
        argv += ["--dtype", cfg.target.dtype]
    if purpose == "serve" and cfg.target.device == "cpu":
        raise ConfigError(
            "target.device: SGLang serves an EAGLE-3 drafter on a GPU only (0.5.23 has no CPU draft attention "
            "backend without Intel AMX); set target.device auto or cuda for the serving host"
        )
    # an extraction server runs on this host, so auto is decided here; a serving command is printed for the
    # serving host, where SGLang decides auto itself
    device = resolved_device(cfg.target.device) if purpose == "extract" else cfg.target.device
    if device != "auto":
        argv += device_flags(device, s.max_total_tokens)
    if purpose == "extract":
        if drafter_dir is not None:
            raise ValueError("an extraction server runs the target alone: no drafter_dir")
        argv += EXTRACT_FLAGS
        if s.tp_size > 1:
            # SGLang fuses a layer's all-reduce into the next layer's norm on its own on some GPUs and models,
            # deferring it to the next layer's read. SGLang before sgl-project/sglang#28343 (merged 2026-06-17)
            # captured a fused layer's input before that all-reduce: each rank's partial sum. 0.5.23 completes
            # the sum before a capture reads it (layers/layer_boundary/stage.py), so there the flag changes no
            # captured value; it guards the older SGLang eagle3 accepts (>= 0.5.6, pyproject.toml).
            fused = [a for a in s.extra_args if a.startswith("--enable-") and "allreduce-fusion" in a]
            if fused:
                raise ConfigError(
                    f"sglang.extra_args: {fused[0]} at tp_size {s.tp_size} makes an SGLang older than "
                    "sgl-project/sglang#28343 read each rank's partial sum as a layer's input; remove it for "
                    "extraction"
                )
            argv += ["--enforce-disable-flashinfer-allreduce-fusion"]
        if aux_layer_ids is not None:
            from eagle3_core.engines.sglang_capture import capture_launch_args

            model = sglang_model(architectures or architectures_of(model_path), str(model_path))
            argv += capture_launch_args(aux_layer_ids, model)
    elif purpose == "serve":
        if drafter_dir is None:
            raise ValueError("serving needs drafter_dir: the exported drafter's sglang directory")
        steps = cfg.evaluate.gate_k if k is None else k
        if steps < 1:
            raise ValueError(f"k must be >= 1, got {steps}")
        argv += [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(drafter_dir),
            "--speculative-num-steps",
            str(steps),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(steps + 1),
        ]
    else:
        raise ValueError(f"purpose must be 'extract' or 'serve', got {purpose!r}")
    return argv + list(s.extra_args)


def device_flags(device: str, max_total_tokens: int | None) -> list[str]:
    """`device_settings` as launch_server flags."""
    flags: list[str] = []
    for name, value in device_settings(device, max_total_tokens).items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


# ---- processes (Linux /proc) ---------------------------------------------------------------------------------
def _running(st: ProcStat | None) -> bool:
    # a zombie has exited (its memory is gone); only its parent's wait() is missing
    return st is not None and st.state not in ("Z", "X", "x")


def group_members(pgid: int, since_ticks: int = 0) -> set[int]:
    """PIDs of the running processes of process group `pgid` started at or after `since_ticks`."""
    members = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None and _running(st) and st.pgrp == pgid and st.start_ticks >= since_ticks:
                members.add(int(entry.name))
    return members


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group emptied in the meantime
        os.killpg(pgid, sig)


# ---- GPU memory probe ----------------------------------------------------------------------------------------
def nvidia_smi_held(pids: Collection[int], exe: str | None = None) -> int:
    """Bytes of GPU memory nvidia-smi reports for `pids`; 0 where there is no nvidia-smi or no GPU.

    nvidia-smi reports PIDs as the host sees them: in a container without the host's PID namespace they do
    not match ours, and this reads 0 (nothing to wait for) rather than waiting for ever.
    """
    exe = exe or shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError:
        return 0
    except subprocess.TimeoutExpired as e:
        raise SGLangServerError(
            f"{exe} did not answer within 60 s: cannot tell whether the GPUs are free"
        ) from e
    if out.returncode != 0:
        return 0  # installed but no driver or no device: no GPU memory to wait for
    held = 0
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) in pids:
            # "[N/A]" (no per-process accounting): held, amount unknown; count it so that it is waited for
            held += (int(parts[1]) if parts[1].isdigit() else 1) * 2**20
    return held


def nvml_held(pids: Collection[int]) -> int | None:
    """The same through NVML (pynvml), when it is installed; None when it cannot answer."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no GPU here
        return None
    try:
        held = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid in pids:
                    held += int(p.usedGpuMemory or 2**20)  # None: held, amount unknown
        return held
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def gpu_memory_held_by(pids: frozenset[int]) -> int:
    """The default probe: NVML if pynvml is importable, else nvidia-smi, else nothing to wait for."""
    held = nvml_held(pids)
    return nvidia_smi_held(pids) if held is None else held


# ---- the PID file ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StopReport:
    pids: frozenset[int]  # every process of the group seen while stopping it
    signal: str  # what ended it: "none" (already gone), "SIGTERM" or "SIGKILL"
    exit_s: float  # from the first signal until no process of the group was left
    gpu_wait_s: float  # then until the probe reported none of their GPU memory


def _quiet(_: str) -> None:
    pass


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# ---- the server --------------------------------------------------------------------------------------------------
class SGLangServer:
    """One managed SGLang server on this host, its PID file and log in the store.

    `with SGLangServer(...) as server:` reaps a stale server first and stops this one on the way out;
    `server.launch(argv)` starts it and waits for `/health_generate`.
    `probe`: bytes of GPU memory held by a set of PIDs (tests pass a fake; the default asks NVML or nvidia-smi).
    """

    def __init__(
        self,
        settings: SGLangServerConfig,
        layout: StoreLayout,
        *,
        probe: GpuProbe = gpu_memory_held_by,
        log: Log = _quiet,
        poll_s: float = 0.5,
        hostname: str | None = None,
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.hostname = hostname or socket.gethostname()
        self.pid_file = layout.sglang_pid_file(self.hostname)
        self.log_file = layout.sglang_log(self.hostname)
        self._probe = probe
        self._log = log
        self._poll_s = poll_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._record: ServerRecord | None = None

    # -- state
    @property
    def url(self) -> str:
        host = self.settings.host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"  # listening everywhere: reach it locally
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.settings.port}"

    @property
    def record(self) -> ServerRecord | None:
        return self._record

    def __enter__(self) -> SGLangServer:
        self.reap_stale()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- start
    def launch(self, argv: Sequence[str]) -> str:
        """Start the server and wait until it answers; its URL."""
        self.start(argv)
        self.wait_healthy()
        return self.url

    def start(self, argv: Sequence[str]) -> ServerRecord:
        """Start `argv` in a new session (its own process group), log to the store, write the PID file."""
        if self._record is not None:
            raise SGLangServerError(f"this server is already started (pid {self._record.pid})")
        self.reap_stale()  # a crashed run's server would hold the GPUs, and maybe the port
        self._check_port_free()
        self.layout.run_dir.mkdir(parents=True, exist_ok=True)
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        marker = new_marker()
        with open(self.log_file, "wb") as log:
            log.write(f"# {started_at} {shlex.join(argv)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # setsid: the server leads its own group, pgid == pid
                    close_fds=True,
                    env=marked_environment(marker),  # what shows a later run that the PID is still ours
                )
            except OSError as e:
                raise ServerStartError(f"cannot start the SGLang server {argv[0]!r}: {e}") from e
        leader, owner = proc_stat(proc.pid), proc_stat(os.getpid())
        record = ServerRecord(
            pid=proc.pid,
            pgid=proc.pid,
            start_ticks=leader.start_ticks if leader else 0,
            hostname=self.hostname,
            port=self.settings.port,
            command=list(argv),
            started_at=started_at,
            owner_pid=os.getpid(),
            owner_start_ticks=owner.start_ticks if owner else None,
            log=str(self.log_file),
            marker=marker,
        )
        record.write(self.pid_file)
        self._proc, self._record = proc, record
        self._log(f"SGLang server started: pid {proc.pid} (its own process group), log {self.log_file}")
        return record

    def _check_port_free(self) -> None:
        # something else answering on the port would pass our health check in the server's place
        host, port = self.settings.host, self.settings.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
            )  # a closed server's TIME_WAIT is no owner
            try:
                sock.bind((host, port))
            except OSError as e:
                raise ServerBusyError(
                    f"port {port} on {host} is already in use ({e.strerror}): another server listens there "
                    "(one started by hand?); stop it or set sglang.port"
                ) from e

    def wait_healthy(self, timeout_s: float | None = None) -> float:
        """Poll `/health_generate` until it answers 200; the seconds waited.

        Fails (stopping the server) if the server exits first or `timeout_s` (default
        `sglang.startup_timeout_s`) passes, with the last lines of its log in the message.
        """
        if self._proc is None:
            raise SGLangServerError("the SGLang server is not started")
        proc = self._proc
        timeout = self.settings.startup_timeout_s if timeout_s is None else timeout_s
        url = self.url + HEALTH_PATH
        start = time.monotonic()
        while True:
            code = proc.poll()
            if code is not None:
                self._fail_start(f"the SGLang server {_describe_exit(code)} before answering {HEALTH_PATH}")
            elapsed = time.monotonic() - start
            # False while not listening, loading (503), or cut off mid-answer
            if http.answers(url, min(10.0, max(0.5, timeout - elapsed))):
                self._log(f"SGLang server healthy at {self.url} after {elapsed:.1f} s")
                return time.monotonic() - start
            if time.monotonic() - start >= timeout:
                self._fail_start(
                    f"the SGLang server did not answer {url} within {timeout:g} s (sglang.startup_timeout_s)"
                )
            time.sleep(self._poll_s)

    def _fail_start(self, message: str) -> NoReturn:
        tail = self.log_tail()
        try:
            self.stop()  # the launcher may be gone while its children still hold GPUs
        except SGLangServerError as err:
            message += f"; stopping what was left of it failed too: {err}"
        raise ServerStartError(f"{message}; it was stopped. The last lines of {self.log_file}:\n{tail}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- stop
    def stop(self) -> StopReport | None:
        """SIGTERM the group, SIGKILL after the grace period, wait until it is gone, then until its GPU memory
        is released. None if nothing was started. Raises ServerGpuMemoryNotReleased after the timeout."""
        record, proc = self._record, self._proc
        if record is None:
            return None
        sent, seen, exit_s = self._terminate(record, proc)
        self._remove_pid_file(record)
        # forgotten before waiting for the GPUs: the processes are gone whatever the driver says
        self._record = self._proc = None
        gpu_s = self._wait_gpu_release(frozenset(seen))
        self._log(
            f"SGLang server stopped ({sent}, {exit_s:.1f} s); its GPU memory was released after {gpu_s:.1f} s"
        )
        return StopReport(frozenset(seen), sent, exit_s, gpu_s)

    def reap_stale(self) -> StopReport | None:
        """Stop a server that a crashed run left on this host (its PID file's owner is gone).

        A PID file whose processes are gone, or whose PID now names another process, is removed. So is one
        whose processes cannot be shown to be the server eagle3 started (`_unproven`: an old or planted
        file): nothing is signalled through it, and the log says why in one line. A server whose owner is
        alive belongs to a run in progress: ServerBusyError, and it is left alone.
        """
        record = self._read_pid_file()
        if record is None or (self._record is not None and record.pid == self._record.pid):
            return None
        members = self._members(record)
        if not members:
            self.pid_file.unlink(missing_ok=True)
            self._log(f"removed the PID file of an SGLang server that is gone (pid {record.pid})")
            return None
        doubt = self._unproven(record, members)
        if doubt is not None:
            self.pid_file.unlink(missing_ok=True)
            self._log(
                f"{self.pid_file} is stale and was removed, nothing signalled: {doubt}; if processes "
                f"{sorted(members)} are an SGLang server of yours, stop them by hand"
            )
            return None
        owner = proc_stat(record.owner_pid)
        owner_alive = _running(owner) and (
            record.owner_start_ticks is None
            or (owner is not None and owner.start_ticks == record.owner_start_ticks)
        )
        if owner_alive:
            raise ServerBusyError(
                f"the SGLang server in {self.pid_file} (pid {record.pid}, port {record.port}) belongs to process "
                f"{record.owner_pid}, which is still running: it is not stale and is left alone; wait for that "
                "run to end, or stop it"
            )
        self._log(
            f"reaping a stale SGLang server left by a run that is gone: pid {record.pid}, processes "
            f"{sorted(members)}, started {record.started_at}"
        )
        sent, seen, exit_s = self._terminate(record, None)
        self.pid_file.unlink(missing_ok=True)
        gpu_s = self._wait_gpu_release(frozenset(seen))
        self._log(f"stale SGLang server reaped ({sent}); GPU memory released after {gpu_s:.1f} s")
        return StopReport(frozenset(seen), sent, exit_s, gpu_s)

    @staticmethod
    def _unproven(record: ServerRecord, members: set[int]) -> str | None:
        """Why the record's running group cannot be shown to be the server eagle3 started (None: it is).

        eagle3 starts the server as the leader of its own group, so the record's group is its PID. The leader
        is checked as eagle3 recorded it (start time, group, command line, the marker in its environment).
        A leader gone with its group still running (SGLang's children die with it, but a child may not) is
        proven by a member carrying the marker: Linux does not reuse a group's id while a member lives.
        """
        if record.pgid != record.pid:
            return f"its group {record.pgid} is not the group of its process {record.pid}"
        doubt = StartedProcess(record.pid, record.start_ticks, record.command, record.marker).mismatch()
        leader_gone = not _running(proc_stat(record.pid))
        marker = record.marker
        if doubt is not None and leader_gone and marker is not None:
            if any(proc_has_marker(pid, marker) for pid in members):
                return None
            return (
                f"its leader {record.pid} is gone, and no process left in its group carries eagle3's marker"
            )
        return doubt

    # -- helpers
    def _members(self, record: ServerRecord) -> set[int]:
        """The running processes of the record's group; none if its PID now names another process.

        Linux never hands out a PID that is still some group's id, so while any member lives, the group
        is ours; and a leader PID alive with another start time means our group is gone and the PID reused.
        """
        leader = proc_stat(record.pid)
        if _running(leader) and leader is not None and leader.start_ticks != record.start_ticks:
            return set()
        return group_members(record.pgid, record.start_ticks)

    def _terminate(
        self, record: ServerRecord, proc: subprocess.Popen[bytes] | None
    ) -> tuple[str, set[int], float]:
        if proc is not None:
            proc.poll()  # reap the leader if it already exited
        seen = self._members(record)
        if not seen:
            return "none", seen, 0.0
        start = time.monotonic()
        _killpg(record.pgid, signal.SIGTERM)
        if self._wait_gone(record, proc, self.settings.shutdown_grace_s, seen):
            return "SIGTERM", seen, time.monotonic() - start
        self._log(
            f"SGLang server still running {self.settings.shutdown_grace_s:g} s after SIGTERM "
            "(sglang.shutdown_grace_s): SIGKILL"
        )
        _killpg(record.pgid, signal.SIGKILL)
        if self._wait_gone(record, proc, KILL_WAIT_S, seen):
            return "SIGKILL", seen, time.monotonic() - start
        left = sorted(self._members(record))
        raise SGLangServerError(
            f"processes {left} of the SGLang server (group {record.pgid}) survived SIGKILL for {KILL_WAIT_S:.0f} s "
            "(stuck in the kernel?): their GPUs are not free"
        )

    def _wait_gone(
        self, record: ServerRecord, proc: subprocess.Popen[bytes] | None, timeout: float, seen: set[int]
    ) -> bool:
        start = time.monotonic()
        while True:
            if proc is not None:
                proc.poll()  # our own child stays a zombie (and its PID taken) until it is waited for
            left = self._members(record)
            seen |= left
            if not left:
                return True
            if time.monotonic() - start >= timeout:
                return False
            time.sleep(min(self._poll_s, 0.1))

    def _wait_gpu_release(self, pids: frozenset[int]) -> float:
        if not pids:
            return 0.0
        timeout = self.settings.gpu_release_timeout_s
        start = time.monotonic()
        while True:
            held = self._probe(pids)
            waited = time.monotonic() - start
            if held <= 0:
                return waited
            if waited >= timeout:
                raise ServerGpuMemoryNotReleased(
                    f"{held / 2**20:.0f} MiB of GPU memory still held by the stopped SGLang server's processes "
                    f"{sorted(pids)} {timeout:g} s after they exited (sglang.gpu_release_timeout_s): the next "
                    "run in the `gpu` pool would not get it, so this run fails here; see `nvidia-smi`"
                )
            time.sleep(self._poll_s)

    def _read_pid_file(self) -> ServerRecord | None:
        try:
            return ServerRecord.read(self.pid_file)
        except FileNotFoundError:
            return None
        except RecordError as e:  # torn, foreign, or a bare PID: it names no process we can trust
            self._log(f"removing unreadable PID file {self.pid_file}, nothing signalled ({e})")
            self.pid_file.unlink(missing_ok=True)
            return None

    def _remove_pid_file(self, record: ServerRecord) -> None:
        current = self._read_pid_file()
        if current is not None and current.pid == record.pid:
            self.pid_file.unlink(missing_ok=True)
