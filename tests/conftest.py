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


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def toy_target_dir() -> Path:
    from eagle3_core.toy.build import ensure_toy_target

    return ensure_toy_target(CACHE, "xs", 0, log=lambda _: None)


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    """A Dagster instance of the test's own, on disk under its tmp_path (runs, events, partitions)."""
    import dagster as dg  # here, not at the top: most tests never load Dagster

    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        yield instance


def write_config(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "eagle3.yaml"
    path.write_text(text)
    return path
