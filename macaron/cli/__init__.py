"""``macaron``: the one command that reads settings and wires the parts together.

Each module of this package holds one group of commands; this one reads the settings once for
every command, lists the commands in the order ``macaron --help`` shows them, and turns a
``MacaronError`` into its code and exit status, and SIGINT or SIGTERM into ``Stopped``."""

from __future__ import annotations

import signal
import sys
from types import FrameType

import typer
from pydantic import ValidationError
from rich.text import Text

from core.errors import ConfigError, MacaronError
from core.settings import Settings
from macaron.cli import (
    harness,
    keys,
    learn,
    log,
    model,
    releases,
    serve,
    specialists,
    stack,
    streams,
    tenants,
)
from macaron.cli.common import err_console

app = typer.Typer(
    help="Macaron server: event-sourced continual-learning LLM server.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # docstrings are plain text: their single line breaks are wraps
    add_completion=False,
)


@app.callback()
def load_settings(ctx: typer.Context) -> None:
    """Read settings (environment variables prefixed MACARON_) once, for every command."""
    try:
        ctx.obj = Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"MACARON_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc


app.command()(stack.up)
app.command()(stack.down)
app.command()(stack.status)
app.command()(serve.serve)
app.command()(serve.schema)
app.command()(learn.worker)
app.command()(learn.train)
app.command()(releases.promote)
app.command()(releases.rollback)
app.command()(log.trace)
app.command("lineage")(releases.lineage_of)
app.command()(releases.registry)
app.command()(streams.replay)
app.command()(learn.simulate)
app.command()(learn.demo)
app.add_typer(stack.db_app, name="db")
app.add_typer(stack.kafka_app, name="kafka")
app.add_typer(log.log_app, name="log")
app.add_typer(model.model_app, name="model")
app.add_typer(keys.keys_app, name="keys")
app.add_typer(tenants.tenants_app, name="tenants")
app.add_typer(streams.streams_app, name="streams")
app.add_typer(releases.contract_app, name="contract")
app.add_typer(harness.harness_app, name="harness")
app.add_typer(specialists.specialist_app, name="specialist")
app.add_typer(log.audit_app, name="audit")


class Stopped(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM arrived. Raised in the main thread wherever it is, it unwinds
    the command so that every ``finally`` stops what the command started; not an ``Exception``
    (nothing catches it on the way) nor a ``KeyboardInterrupt`` (Click would make that an
    "Aborted!" exiting 1)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


def _raise_stopped(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signum)


def main() -> None:
    """Run the command; a ``MacaronError`` prints its code and exits 2 (settings) or 1;
    SIGINT or SIGTERM says so and exits 128 + the signal's number (130, 143), as a shell
    reports a process a signal ended."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_stopped)
    try:
        app()
    except Stopped as stopped:
        err_console.print(f"stopped by {stopped.signal.name}", highlight=False)
        sys.exit(128 + stopped.signal.value)
    except MacaronError as exc:
        message = Text.assemble(("error", "bold red"), f"[{exc.code}]: {exc.message}")
        err_console.print(message, soft_wrap=True)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
