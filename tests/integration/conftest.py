"""A real PostgreSQL server for the deployment's instance files (docker/dagster.yaml, docker/k8s/dagster.yaml):
Debian's server started on 127.0.0.1 once per test module, and a database of its own per test, with the
DAGSTER_POSTGRES_* variables those files read pointed at it. Without the server binaries or the drivers a test
is skipped, except in CI (CI=true), where it fails: there the deployment's storage must be tested."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NoReturn

import pytest

from tests.conftest import in_ci
from tests.postgres_server import PostgresServer, create_database, postgres_bin_dir, running_postgres


def _missing(reason: str) -> NoReturn:
    if in_ci():
        pytest.fail(f"{reason} (CI=true: the deployment's storage test must run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        _missing("PostgreSQL's server binaries are not installed (Debian: apt-get install postgresql)")
    try:
        import dagster_postgres  # noqa: F401
        import psycopg2  # noqa: F401
    except ImportError as err:
        _missing(f"{err.name} is not installed (make installs dagster-postgres and psycopg2-binary)")
    with running_postgres(bin_dir) as server:
        yield server


@pytest.fixture
def postgres_database(postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new database on the server, its name; DAGSTER_POSTGRES_* (the instance files' credentials) point at it."""
    db_name = f"dagster_{os.urandom(4).hex()}"
    create_database(postgres.dsn(), db_name)
    for name, value in {**postgres.dagster_env(), "DAGSTER_POSTGRES_DB": db_name}.items():
        monkeypatch.setenv(name, value)
    return db_name
