"""`make bench` from a fresh clone: every recipe line runs a bench as a module of the repository's `bench`
package, and each of them imports there (running one as `python bench/x.py` could not find `bench._common`)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def _bench_recipe() -> list[str]:
    lines = (REPO / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("bench:")))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_bench_runs_each_bench_as_a_module_that_imports_from_the_repository() -> None:
    recipe = _bench_recipe()
    modules = [
        m.group(1) for line in recipe if (m := re.fullmatch(r"\$\(BIN\)/python -m (bench\.\w+)", line))
    ]
    assert modules and len(modules) == len(recipe), recipe
    for module in modules:
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    assert callable(importlib.import_module(m).main), m"
    result = subprocess.run(
        [sys.executable, "-c", code, *modules], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
