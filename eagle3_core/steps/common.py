"""What every step takes and returns: a log to report progress to, and its result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from eagle3_core.config import without_url_passwords
from eagle3_core.store.records import Record

Log = Callable[[str], None]
R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class StepResult:
    key: str
    path: Path
    metadata: dict[str, Any]
    # the typed record the step wrote (a run summary, an evaluation report), for a caller that renders more
    # than the flat metadata, so that it never reads the file again or decodes the metadata's JSON
    record: Record | None = None
    # records the step wrote beside it (an evaluation's serving recommendation), for the same callers
    extra_records: tuple[Record, ...] = ()

    def __post_init__(self) -> None:
        # the metadata is printed (CLI) and recorded (Dagster's event log): a URL's password never is, whichever
        # step put the URL there
        shown = {k: without_url_passwords(v) if isinstance(v, str) else v for k, v in self.metadata.items()}
        object.__setattr__(self, "metadata", shown)

    def record_as(self, kind: type[R]) -> R:
        """The step's record as a `kind`; TypeError for a step that returned another record or none."""
        if not isinstance(self.record, kind):
            raise TypeError(f"step {self.key} returned no {kind.__name__} (got {type(self.record).__name__})")
        return self.record

    def extra_record(self, kind: type[R]) -> R | None:
        """The first of the step's further records that is a `kind`, None when it wrote none."""
        return next((r for r in self.extra_records if isinstance(r, kind)), None)


def quiet(_: str) -> None:
    """A log that drops every line: for a caller with nowhere to show progress."""
