"""What one demo runs (``run_demo``'s options, ``macaron demo``'s flags): how many generations
and how much traffic each, on which specialists, in which mode, seeded how."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from core.errors import ConfigError
from learners.rollouts.environments import HintMode
from macaron.demo.stage import RolloutPlace
from macaron.simulator import DEFAULT_SPECIALISTS

Mode = Literal["oracle", "self"]
RUN_TIMEOUT_S = 3 * 3600.0
"""Longest wait for the runs of one generation to be trained, evaluated and decided."""


@dataclass(frozen=True)
class DemoOptions:
    """``generations`` generations after the measure of the active release, each of at most
    ``turns_per_generation`` simulated turns (``oracle``) or prompts rolled out with ``samples``
    samples each (``self``) and up to ``budget`` for a prompt whose groups are flat (``None``:
    ``samples``, none more), with ``written`` tasks the loop writes itself per rollout job of a
    specialist it writes for, ``concurrency`` at once, on ``specialists``' tasks in an order
    seeded by ``seed``; groups with no passing sample resampled as ``hints`` says; rollouts
    sampled where ``rollouts`` says; with ``outside``, each generation's release also measured
    on the outside measure (BFCL's requests no tool serves: its no-call rate); a run that takes
    longer than ``run_timeout_s`` fails the demo. ``demo.json`` and ``demo.png`` go to
    ``out_dir``."""

    generations: int
    turns_per_generation: int
    concurrency: int
    out_dir: Path
    specialists: Sequence[str] = DEFAULT_SPECIALISTS
    seed: int = 0
    mode: Mode = "oracle"
    samples: int = 8
    budget: int | None = None
    written: int = 2
    outside: bool = True
    hints: HintMode = "none"
    rollouts: RolloutPlace = "worker"
    run_timeout_s: float = RUN_TIMEOUT_S


def check_options(o: DemoOptions) -> None:
    """``ConfigError`` for options no demo can run with, before anything starts."""
    if min(o.generations, o.turns_per_generation, o.concurrency) < 1:
        raise ConfigError("generations, turns per generation and concurrency must be at least 1")
    if not 0 <= o.written <= 32:
        raise ConfigError(f"written tasks per job must be from 0 to 32, not {o.written}")
    if o.budget is not None and not o.samples <= o.budget <= 64:
        raise ConfigError(f"budget {o.budget} must be from --samples ({o.samples}) to 64")
    if o.hints not in get_args(HintMode):
        raise ConfigError(f"no hint mode {o.hints!r}; one of {', '.join(get_args(HintMode))}")
    if o.rollouts not in get_args(RolloutPlace):
        raise ConfigError(f"rollouts run in the worker or the server, not {o.rollouts!r}")
    if o.hints != "none" and o.mode != "self":
        raise ConfigError("hints are given to rollouts: only --mode self takes them")


@dataclass(frozen=True)
class Traffic:
    """A generation's traffic: simulated users (``oracle``), or rollouts (``self``) of
    ``samples`` samples per prompt (up to ``budget`` where they are flat: adaptive sampling)
    and ``written`` tasks the loop writes itself per job of the specialists it ``writes`` for,
    seeded from ``seed``, hinted as ``hints`` says."""

    mode: Mode
    samples: int
    budget: int
    written: int
    writes: frozenset[str]
    """The specialists the loop writes tasks for: those with a family the bank shows."""
    seed: int
    hints: HintMode
