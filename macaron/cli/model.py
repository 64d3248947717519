"""Base models: ``model pull`` and ``model tiny``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infra.models import (
    TINY_FAMILIES,
    make_tiny_model,
    pull_model,
    tokenizer_for_tiny,
    verify_model,
)
from macaron.cli.common import console, settings, steps

model_app = typer.Typer(help="Base models: pull, make a tiny test model.", no_args_is_help=True)


@model_app.command("pull")
def model_pull(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Model to fetch.")] = "smollm2-135m-instruct",
) -> None:
    """Fetch and convert a base model once into MACARON_HOME/models (idempotent)."""
    cfg = settings(ctx)
    with steps(f"{name}: starting") as step:
        folder, changed = pull_model(cfg.home, name, lambda s: step(f"{name}: {s}"))
    manifest = verify_model(folder)
    state = "pulled" if changed else "already pulled"
    console.print(f"{name} {state}: {folder} (licence {manifest['licence']})")


@model_app.command("tiny")
def model_tiny(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="Folder to write the tiny model into.")],
    seed: Annotated[int, typer.Option(help="Random seed for the weights.")] = 0,
    family: Annotated[
        str, typer.Option(help=f"Architecture: {', '.join(TINY_FAMILIES)}.")
    ] = "llama",
) -> None:
    """Make a tiny random model (Llama, Qwen2 or Mistral) with SmolLM2's tokenizer, in
    seconds, for tests."""
    if family not in TINY_FAMILIES:
        raise typer.BadParameter(
            f"no tiny {family!r} model; one of {', '.join(TINY_FAMILIES)}", param_hint="--family"
        )
    cfg = settings(ctx)
    with steps("tokenizer") as step:
        tokenizer = tokenizer_for_tiny(cfg.home, step)
        step("writing the model")
        make_tiny_model(path, tokenizer, seed=seed, family=family)
    console.print(f"tiny model written to {path}")
