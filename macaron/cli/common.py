"""What every command shares: the settings the root command loaded, the consoles, a spinner."""

from __future__ import annotations

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


def spinner() -> Progress:
    """A spinner on stderr with the current step and the time so far."""
    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console
    )


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
