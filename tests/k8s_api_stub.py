"""A stand-in for the Kubernetes API server, which cannot run here: just enough of its pod API for
dagster-k8s's `PipesK8sClient.run` (and the `wait_for_pod` it calls) to run a pod end to end, and of its Job API
for `K8sRunLauncher.launch_run` to create a run's Job (recorded, never run). A pod is a local
process group: its first container's `command` + `args`, with the container's `env` over os.environ, in the
current directory (the image is ignored); like a container, it ends when that first process does.

Served, namespace from the URL; anything else is a 404 with a Status:
  POST   /api/v1/namespaces/{ns}/pods              starts the pod; its stdout and stderr make one log
  GET    /api/v1/namespaces/{ns}/pods              a PodList, fieldSelector=metadata.name=NAME honoured
  GET    /api/v1/namespaces/{ns}/pods/{name}
  GET    /api/v1/namespaces/{ns}/pods/{name}/log   follow (chunked), timestamps, tailLines; sinceSeconds ignored
  DELETE /api/v1/namespaces/{ns}/pods/{name}       kills the pod's processes
  POST   /apis/batch/v1/namespaces/{ns}/jobs       records the Job (no pod is started for it)

A pod reads Running (its container running and ready) while its process runs and for at least
`min_running_seconds` after it started, like a kubelet yet to notice a quick exit, so that `wait_for_pod`
always leaves its Ready wait by its Ready exit; then Succeeded or Failed, the container terminated.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes
import yaml

from tests.fakes import FakeHandler, FakeHTTPServer

ROUTE = re.compile(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)(/log)?)?")
JOBS = re.compile(r"/apis/batch/v1/namespaces/([^/]+)/jobs")


def _rfc3339(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    status: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
    return status | {"reason": reason, "code": code}


@dataclass
class _Pod:
    body: dict[str, Any]  # as POSTed, with its namespace
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.time)
    lines: list[tuple[str, bytes]] = field(default_factory=list)  # (RFC3339Nano timestamp, line)
    exit_code: int | None = None  # set after the last line
    finished: float = 0.0
    changed: threading.Condition = field(default_factory=threading.Condition)

    def capture(self) -> None:
        """On a thread: the output, a strictly increasing timestamp per line (dagster-k8s glues lines with
        equal timestamps together), then the exit code."""
        assert self.process.stdout is not None
        last = 0
        for line in self.process.stdout:
            last = max(time.time_ns(), last + 1)
            with self.changed:
                self.lines.append((f"{_rfc3339(last // 10**9)[:-1]}.{last % 10**9:09d}Z", line.rstrip(b"\n")))
                self.changed.notify_all()
        code = self.process.wait()
        with self.changed:  # killed by a signal: 128 + its number, as a container runtime reports it
            self.exit_code, self.finished = 128 - code if code < 0 else code, time.time()
            self.changed.notify_all()

    def end(self) -> None:
        """On a thread: once the first process has ended, the others end with it (and the output with them)."""
        self.process.wait()
        self.kill()

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the pod's own process group, led by its process

    def log(self, sent: int, stamped: bool, wait: bool) -> tuple[bytes, int, bool]:
        """The log after its first `sent` lines (with `wait`, once there is a line or the end), the number of
        lines sent then, and whether the process has ended (so no line is to come)."""
        with self.changed:
            if wait:
                self.changed.wait_for(lambda: len(self.lines) > sent or self.exit_code is not None)
            lines = self.lines[sent:]
            data = b"".join((f"{t} ".encode() if stamped else b"") + line + b"\n" for t, line in lines)
            return data, sent + len(lines), self.exit_code is not None

    def json(self, min_running_seconds: float) -> dict[str, Any]:
        code = self.exit_code if time.time() - self.started >= min_running_seconds else None
        times = {"startedAt": _rfc3339(self.started)}
        state: dict[str, Any] = {"running": times}
        if code is not None:
            times["finishedAt"] = _rfc3339(self.finished)
            state = {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed", **times}}
        container = self.body["spec"]["containers"][0]
        status = {"name": container["name"], "image": container.get("image", ""), "imageID": ""}
        status |= {"ready": code is None, "restartCount": 0, "state": state}
        phase = "Running" if code is None else "Failed" if code else "Succeeded"
        pod_status = {"phase": phase, "startTime": times["startedAt"], "containerStatuses": [status]}
        return {**self.body, "apiVersion": "v1", "kind": "Pod", "status": pod_status}


class KubernetesApiStub:
    """The API on a free loopback port while in a `with`. `created`: the pod bodies POSTed (camelCase, as the
    client sent them, with the namespace of the URL in their metadata); `deleted`: the names deleted; `jobs`: the
    Job bodies POSTed, as `created`. On exit the pods' processes are killed, and the kubernetes client's default
    configuration (which loading the kubeconfig replaces) is put back."""

    def __init__(self, min_running_seconds: float = 0.5) -> None:
        self.min_running_seconds = min_running_seconds
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.jobs: list[dict[str, Any]] = []
        self.pods: dict[tuple[str, str], _Pod] = {}
        self._started: list[_Pod] = []  # deleted ones too
        self._lock = threading.Lock()
        self._server = FakeHTTPServer(_Handler, self)

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stub", "cluster": {"server": self._server.url}}],
            "users": [{"name": "stub", "user": {"token": "stub-token"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
            "current-context": "stub",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def create(self, namespace: str, body: dict[str, Any]) -> _Pod | None:
        """The pod started, or None when one of its name exists."""
        container = body["spec"]["containers"][0]
        argv = [*container.get("command", []), *container.get("args", [])]
        env = {**os.environ, **{e["name"]: e.get("value", "") for e in container.get("env", [])}}
        with self._lock:
            if (namespace, body["metadata"]["name"]) in self.pods:
                return None
            body = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
            self.created.append(body)
            process = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
            pod = _Pod(body, process)
            self.pods[namespace, body["metadata"]["name"]] = pod
            self._started.append(pod)
        for work in (pod.capture, pod.end):
            threading.Thread(target=work, daemon=True).start()
        return pod

    def create_job(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The Job recorded, or None when one of its name exists in its namespace."""
        body = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
        key = (namespace, body["metadata"]["name"])
        with self._lock:
            if any((j["metadata"]["namespace"], j["metadata"]["name"]) == key for j in self.jobs):
                return None
            self.jobs.append(body)
        return body

    def delete(self, namespace: str, name: str) -> _Pod | None:
        with self._lock:
            pod = self.pods.pop((namespace, name), None)
        if pod is not None:
            pod.kill()
            self.deleted.append(name)
        return pod

    def __enter__(self) -> KubernetesApiStub:
        self._configuration = kubernetes.client.Configuration.get_default_copy()
        self._server.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for pod in self._started:
            pod.kill()
            pod.process.wait()
        self._server.__exit__(exc_type, exc, tb)
        kubernetes.client.Configuration.set_default(self._configuration)


class _Handler(FakeHandler):
    protocol_version = "HTTP/1.1"  # for chunked log streams, which urllib3 hands on as they come
    server: FakeHTTPServer[KubernetesApiStub]

    def _serve(self) -> None:
        stub, url, method = self.server.state, urlsplit(self.path), self.command
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = self.json_body() if int(self.headers.get("Content-Length") or 0) else None
        if (jobs := JOBS.fullmatch(url.path)) and method == "POST" and body:
            if job := stub.create_job(jobs.group(1), body):
                return self.reply(201, job)
            return self.reply(
                409, _status(409, "AlreadyExists", f'jobs.batch "{body["metadata"]["name"]}" exists')
            )
        route = ROUTE.fullmatch(url.path)
        namespace, name, log = route.groups() if route else ("", None, None)
        pod = stub.pods.get((namespace, name)) if name else None
        if route and method == "POST" and not name and body:
            if created := stub.create(namespace, body):
                return self.reply(201, created.json(stub.min_running_seconds))
            return self.reply(409, _status(409, "AlreadyExists", f'pods "{body["metadata"]["name"]}" exists'))
        if route and method == "GET" and not name:
            wanted = query.get("fieldSelector", "").removeprefix("metadata.name=")
            pods = [p for (ns, n), p in list(stub.pods.items()) if ns == namespace and wanted in ("", n)]
            items = [p.json(stub.min_running_seconds) for p in pods]
            return self.reply(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
        if method == "GET" and pod and log:
            return self._log(pod, query)
        if method == "GET" and pod:
            return self.reply(200, pod.json(stub.min_running_seconds))
        if method == "DELETE" and name and (deleted := stub.delete(namespace, name)):
            return self.reply(200, deleted.json(stub.min_running_seconds))
        what = f'pods "{name}"' if name else f"{method} {url.path}"
        self.reply(404, _status(404, "NotFound", f"{what} not found"))

    do_GET = do_POST = do_DELETE = _serve

    def _log(self, pod: _Pod, query: dict[str, str]) -> None:
        """The log (its last tailLines), then with follow each line as it comes, until the process has ended."""
        # the kubernetes client sends its booleans as True and False
        stamped, follow = (query.get(k, "").lower() == "true" for k in ("timestamps", "follow"))
        sent = max(0, len(pod.lines) - int(query["tailLines"])) if "tailLines" in query else 0
        if not follow:
            return self.reply(200, pod.log(sent, stamped, wait=False)[0])
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        ended = False
        while not ended:
            data, sent, ended = pod.log(sent, stamped, wait=True)
            if data:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
