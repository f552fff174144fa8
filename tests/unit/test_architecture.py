"""The house rules, read from the source with ast (nothing is imported), each shown to catch a planted breach:

- the library (eagle3_core) imports neither dagster, rich nor argparse, nor the rooms built on it;
- no module, the tests' included, imports another module's private name;
- eagle3_core's layers only import downward:
  conventions/config < store < data < targets/engines < draft < train < export < evaluate < steps,
  and the Dagster room never imports the CLI's;
- an asset or check body stays short (about 15 lines): it calls the core and renders the result.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest

from tests.conftest import REPO

FIRST_PARTY = ("eagle3_core", "eagle3_dagster", "eagle3_cli", "bench")
WITH_TESTS = (*FIRST_PARTY, "tests")
NOT_IN_THE_LIBRARY = (
    "dagster",
    "dagster_graphql",
    "dagster_webserver",
    "rich",
    "argparse",
    "eagle3_dagster",
    "eagle3_cli",
)
LAYER = {
    "conventions": 0, "errors": 0, "config": 0, "config_doc": 0, "procs": 0, "finite": 0,
    "store": 1,
    "data": 2,
    "targets": 3, "engines": 3, "toy": 3,
    "draft": 4,
    "train": 5,
    "export": 6,
    "evaluate": 7,
    "steps": 8,
}  # fmt: skip
BODY_LIMIT = 15
ASSET_DECORATORS = ("asset", "asset_check", "multi_asset", "multi_asset_check")


def modules(room: str) -> Iterator[tuple[str, str]]:
    for path in sorted((REPO / room).rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        yield name, path.read_text()


def imported(source: str) -> Iterator[tuple[str, list[str], int]]:
    """(module, names taken from it, line) for every import, at any depth (function-level ones too)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names], node.lineno


def library_breaches(module: str, source: str) -> list[str]:
    if not module.startswith("eagle3_core"):
        return []
    return [
        f"{module}:{line} imports {name}"
        for name, _, line in imported(source)
        if name.split(".")[0] in NOT_IN_THE_LIBRARY
    ]


def private_imports(module: str, source: str) -> list[str]:
    return [
        f"{module}:{line} imports {name}.{item}"
        for name, items, line in imported(source)
        if name.split(".")[0] in WITH_TESTS and name != module
        for item in items
        if item.startswith("_") and not item.startswith("__")
    ]


def layer_breaches(module: str, source: str) -> list[str]:
    parts = module.split(".")
    if parts[0] == "eagle3_dagster":
        return [
            f"{module}:{line} imports {n}" for n, _, line in imported(source) if n.startswith("eagle3_cli")
        ]
    if parts[0] != "eagle3_core" or len(parts) < 2:
        return []
    if parts[1] not in LAYER:
        return [f"{module}: eagle3_core.{parts[1]} has no layer (add it to LAYER)"]
    out = []
    for name, _, line in imported(source):
        other = name.split(".")
        if other[0] == "eagle3_core" and len(other) > 1 and LAYER.get(other[1], 99) > LAYER[parts[1]]:
            out.append(f"{module}:{line} ({parts[1]}) imports {name}, a layer above it")
    return out


def long_asset_bodies(module: str, source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
        names = {d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "") for d in decorators}
        if not names & set(ASSET_DECORATORS):
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        lines = (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1 if body else 0
        if lines > BODY_LIMIT:
            out.append(f"{module}.{node.name}: a body of {lines} lines (at most {BODY_LIMIT})")
    return out


RULES = {
    "library": library_breaches,
    "private": private_imports,
    "layers": layer_breaches,
    "asset bodies": long_asset_bodies,
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_repository_keeps_the_rule(rule: str) -> None:
    rooms = WITH_TESTS if rule == "private" else FIRST_PARTY
    breaches = [b for room in rooms for m, source in modules(room) for b in RULES[rule](m, source)]
    assert breaches == []


PLANTED = {
    "library": ("eagle3_core.train.trainer", "def f():\n    from rich.console import Console\n"),
    "private": ("eagle3_core.steps.drafter", "from eagle3_core.steps.common import Log, _quiet\n"),
    "layers": ("eagle3_core.store.checks", "from eagle3_core.draft.vocab import VocabMapping\n"),
    "asset bodies": (
        "eagle3_dagster.defs.data.assets",
        "import dagster as dg\n@dg.asset(group_name='data')\ndef big(context):\n    '''doc'''\n"
        + "".join(f"    x{i} = {i}\n" for i in range(BODY_LIMIT + 1)),
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_catches_a_planted_breach(rule: str) -> None:
    module, source = PLANTED[rule]
    assert len(RULES[rule](module, source)) == 1
    assert RULES["layers"]("eagle3_dagster.defs.resources", "from eagle3_cli.steps import console\n")
    assert RULES["private"]("tests.integration.test_x", "from tests.integration.test_y import _helper\n")
    assert RULES["layers"]("eagle3_core.newroom.x", "") == [
        "eagle3_core.newroom.x: eagle3_core.newroom has no layer (add it to LAYER)"
    ]
