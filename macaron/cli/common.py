"""What every command shares: the settings the root command loaded, the consoles, how a long
command reports its steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from core.errors import ConfigError
from core.settings import Settings

console = Console()
err_console = Console(stderr=True)
"""Progress and messages for the operator go to stderr; results go to stdout."""


def settings(ctx: typer.Context) -> Settings:
    """The settings ``macaron``'s callback read once for this invocation."""
    value = ctx.obj
    if not isinstance(value, Settings):
        raise ConfigError("settings were not loaded")
    return value


def _spinner() -> Progress:
    """A spinner on stderr with the current step and the time so far."""
    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console
    )


@contextmanager
def steps(first: str) -> Iterator[Callable[[str], None]]:
    """How a long command reports its step: on a terminal, a spinner with the current step;
    elsewhere (a log file, a pipe, CI), one line on stderr per new step with the seconds since
    the start, so a run that is not watched still says where it is."""
    if err_console.is_terminal:
        with _spinner() as progress:
            task = progress.add_task(first)
            yield lambda step: progress.update(task, description=step)
        return
    started, last = time.monotonic(), [""]

    def report(step: str) -> None:
        if step != last[0]:
            last[0] = step
            err_console.print(f"[{time.monotonic() - started:7.1f} s] {step}", highlight=False)

    report(first)
    yield report


def progress_bar() -> Progress:
    """A progress bar on stderr: the step, done of total, and the time so far."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
    )


def specialist_names(listed: str) -> list[str]:
    """The names of a comma-separated ``--specialists`` option."""
    names = [name.strip() for name in listed.split(",") if name.strip()]
    if not names:
        raise ConfigError("--specialists names no specialist (for example genui,agent)")
    return names
