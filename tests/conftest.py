"""Shared fixtures. The toy target (xs) is built once per machine into the repository's .cache/ and reused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import dagster as dg

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "eagle3"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROJECT_VARIABLES = ("DAGSTER_HOME", "EAGLE3_CONFIG")  # what the CLI sets in its own process (ops.activate)


@pytest.fixture(autouse=True)
def cli_environment_restored() -> Iterator[None]:
    """`eagle3 ...` run in process (eagle3_cli.main.main) points the process at its project by setting
    DAGSTER_HOME and EAGLE3_CONFIG, as the console script must; after each test they are as they were, so a
    later test's subprocess (`{**os.environ}`) never inherits an earlier test's instance."""
    before = {name: os.environ.get(name) for name in PROJECT_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def toy_target_dir() -> Path:
    from eagle3_core.toy.build import ensure_toy_target

    return ensure_toy_target(CACHE, "xs", 0, log=lambda _: None)


@pytest.fixture(scope="session")
def smollm2_target_dir() -> Path:
    """SmolLM2-135M-Instruct (target.path smollm2) as eagle3 materialises it, built once per machine (about a
    minute on 2 cores) into the cache the toy uses; `make test` installs the wheel it is built from."""
    from eagle3_core.targets.gguf import ensure_gguf_target, gguf_source

    return ensure_gguf_target(CACHE, gguf_source("smollm2", Path), log=lambda _: None)


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    """A Dagster instance of the test's own, on disk under its tmp_path (runs, events, partitions)."""
    import dagster as dg  # here, not at the top: most tests never load Dagster

    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        yield instance


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module whose models are tiny (pytestmark usefixtures). Their ops are on a few
    dozen numbers, so a second OpenMP thread only adds a hand-off per op, and on a busy 2-core machine (CI's,
    shared with other tests' processes) each hand-off waits for a core: a greedy generate took 17 s on two
    threads and 0.13 s on one, a 32x32 linear 0.6 ms."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_config(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "eagle3.yaml"
    path.write_text(text)
    return path
