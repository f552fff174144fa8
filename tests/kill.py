"""A step SIGKILLed at each of its renames, in a real child process: every point where a writer can die.

A writer's renames are where what others see changes (a temporary put under its final name, a link moved), so
killing the child instead of making its nth rename, for n = 1, 2, ... until a run makes no nth rename and
finishes, tries every state a crash can leave. The children are forked from a forkserver that imported the
steps once (a fresh interpreter per point would import torch each time), so a point costs a fork
and the step. The steps below are the ones the CLI and the Dagster assets run, at module level: the child
gets them by name.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_core.config import load_config
from eagle3_core.steps.drafter import export_step
from eagle3_core.steps.evaluation import promote_step

PRELOAD = ["tests.kill", "eagle3_cli.main"]  # Dagster, in the one child that needs it


def eagle3(*argv: str) -> None:
    """The `eagle3` command (its console script's main), exiting with its status."""
    from eagle3_cli.main import main

    sys.exit(main(list(argv)))


def eagle3_on_one_thread(*argv: str) -> None:
    """`eagle3` on one intra-op thread, for a tiny target whose ops a second thread only slows down (as
    tests/conftest.py `one_torch_thread` does in the test's own process)."""
    import torch

    torch.set_num_threads(1)
    eagle3(*argv)


def export_latest(config: Path) -> None:
    """`eagle3 export`: the newest trained drafter in both formats."""
    export_step(load_config(config))


def promote_latest(config: Path) -> None:
    """The promotion of `eagle3 eval --promote` (after its evaluation)."""
    promote_step(load_config(config))


def promote_through_dagster(config: Path) -> None:
    """The drafter_current asset, materialized as a Dagster run does it."""
    import dagster as dg

    from eagle3_dagster.defs.evaluation.assets import drafter_current
    from eagle3_dagster.defs.resources import Eagle3Resource

    dg.materialize([drafter_current], resources={"eagle3": Eagle3Resource(config_path=str(config))})


def run_killed_at_rename(n: int, step: Callable[..., Any], *args: Any) -> int:
    """Run `step(*args)` in a child that SIGKILLs itself in place of its nth os.rename/os.replace; its exit
    code: -SIGKILL when it got there, 0 when it made fewer renames and finished."""
    return run_child(killing_at_rename, n, step, args)


def run_killed_at_call(where: str, step: Callable[..., Any], *args: Any) -> int:
    """Run `step(*args)` in a child that SIGKILLs itself when it calls `where` ("module:Name.attr"), in
    place of that call; its exit code (-SIGKILL when it got there)."""
    return run_child(killing_at_call, where, step, args)


def run_killed_at_nth_call(where: str, n: int, step: Callable[..., Any], *args: Any) -> int:
    """Run `step(*args)` in a child whose calls of `where` ("module:Name.attr") go through until the nth,
    which SIGKILLs the child in its place; its exit code (-SIGKILL when it got there, 0 when it finished)."""
    return run_child(killing_at_nth_call, where, n, step, args)


def run_child(target: Callable[..., None], *args: Any) -> int:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # only before the server's first start; later it is kept
    child = context.Process(target=target, args=args)
    child.start()
    child.join(120)
    if child.exitcode is None:
        child.kill()
        child.join()
        raise TimeoutError(f"{target.__name__}{args} did not end in 120 s")
    return child.exitcode


def killing_at_rename(n: int, step: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """In the child: os.rename and os.replace counted together; the nth call kills the process instead."""
    calls = iter(range(1, 10**9))
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def counted(*a: Any, _real: Callable[..., Any] = real, **kw: Any) -> Any:
            if next(calls) == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*a, **kw)

        setattr(os, name, counted)
    step(*args)


def killing_at_call(where: str, step: Callable[..., Any], args: tuple[Any, ...]) -> None:
    killing_at_nth_call(where, 1, step, args)


def killing_at_nth_call(where: str, n: int, step: Callable[..., Any], args: tuple[Any, ...]) -> None:
    module, _, path = where.partition(":")
    *parents, name = path.split(".")
    owner = importlib.import_module(module)
    for parent in parents:
        owner = getattr(owner, parent)
    real = getattr(owner, name)
    calls = iter(range(1, 10**9))

    def counted(*a: Any, **kw: Any) -> Any:
        if next(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)

    setattr(owner, name, counted)
    step(*args)


def hidden_leftovers(root: Path) -> list[str]:
    """Temporaries and moved-aside entries (hidden names) anywhere under `root`, links not followed."""
    return sorted(
        os.path.relpath(os.path.join(d, name), root)
        for d, dirs, files in os.walk(root)
        for name in [*dirs, *files]
        if name.startswith(".")
    )


def every_crash_point(
    step: Callable[..., Any],
    args: tuple[Any, ...],
    reset: Callable[[], None],
    check: Callable[[int], None],
    most: int = 30,
) -> int:
    """For n = 1, 2, ...: `reset()` the store, run `step(*args)` killed at its nth rename, and `check(n)` what
    the crash left; until a run makes no nth rename and finishes. Returns how many points were tried."""
    for n in range(1, most + 1):
        reset()
        code = run_killed_at_rename(n, step, *args)
        if code == 0:
            return n - 1
        assert code == -signal.SIGKILL, f"{step.__name__} killed at rename {n} exited {code}, not by SIGKILL"
        check(n)
    raise AssertionError(f"{step.__name__} made more than {most} renames")
