"""The CLI's progress: bars in a terminal, every line kept where output goes to a file or a pipe."""

import io

from rich.console import Console

from eagle3_cli.steps import ProgressLog


def test_a_terminal_gets_one_bar_per_task_closed_when_all_are_done() -> None:
    out = io.StringIO()
    log = ProgressLog(Console(file=out, force_terminal=True, width=100))
    log("chat-00000: 64/128 samples extracted")
    assert log.bars is not None and len(log.bars.tasks) == 1
    log("chat-00001: 10/20 samples regenerated")
    log("chat-00000: 128/128 samples extracted")
    assert log.bars is not None and len(log.bars.tasks) == 2  # one task still running
    log("chat-00001: 20/20 samples regenerated")
    assert log.bars is None  # everything finished: the live display is closed
    log("vocab: done")  # an ordinary line is printed as it is
    text = out.getvalue()
    assert "chat-00000 (samples extracted)" in text and "vocab: done" in text


def test_a_pipe_gets_every_line_and_no_bar() -> None:
    out = io.StringIO()
    log = ProgressLog(Console(file=out, force_terminal=False, width=100))
    for done in (64, 128):
        log(f"chat-00000: {done}/128 samples extracted")
    assert log.bars is None
    assert out.getvalue().splitlines() == [
        "chat-00000: 64/128 samples extracted",
        "chat-00000: 128/128 samples extracted",
    ]


def test_a_line_with_brackets_is_printed_as_it_is_not_read_as_markup() -> None:
    """A step's line is text: a reason quoting `[redacted api key]` or a list keeps its brackets."""
    out = io.StringIO()
    log = ProgressLog(Console(file=out, force_terminal=False, width=200))
    log("chat-00000: 2 requests failed: 401 Incorrect API key: Bearer [redacted api key]")
    log("aux layers [2, 15, 27] [bold]")
    assert out.getvalue().splitlines() == [
        "chat-00000: 2 requests failed: 401 Incorrect API key: Bearer [redacted api key]",
        "aux layers [2, 15, 27] [bold]",
    ]


def test_a_progress_line_with_details_drives_a_bar_that_shows_them() -> None:
    """Regeneration's lines carry tokens, rate and ETA after a semicolon (its rate has a slash): still a bar."""
    out = io.StringIO()
    log = ProgressLog(Console(file=out, force_terminal=True, width=160))
    log("chat-00000: 12/40 samples regenerated; 1834 new tokens, 55.2 tokens/s, ETA 1m31s")
    assert log.bars is not None and len(log.bars.tasks) == 1
    log("chat-00000: 40/40 samples regenerated; 6012 new tokens, 56.0 tokens/s, ETA 0s")
    assert log.bars is None
    text = out.getvalue()
    assert "chat-00000 (samples regenerated)" in text and "56.0 tokens/s, ETA 0s" in text
