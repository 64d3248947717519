"""The demo's options are checked before anything starts: an unknown hint mode, hints in oracle
mode, a place for rollouts other than the worker or the server, and a self mode whose training
config would take edits are each a ``ConfigError`` (and the command line refuses an unknown
``--hints`` or ``--rollouts`` by name), and so is a rollout budget smaller than one group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.errors import ConfigError
from core.settings import Settings
from learners.recipes.config import CPU_CONFIG, RLOO_CONFIG, load_config
from macaron.cli import app
from macaron.demo import DemoOptions, demo_settings, run_demo


def demo(tmp_path: Path, settings: Settings | None = None, **options: Any) -> None:
    run_demo(
        settings or Settings(home=tmp_path),
        DemoOptions(
            generations=1,
            turns_per_generation=1,
            concurrency=1,
            out_dir=tmp_path / "demo",
            **options,
        ),
    )


def test_an_unknown_hint_mode_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no hint mode 'reference'; one of none, tools, checker"):
        demo(tmp_path, mode="self", hints="reference")
    assert not (tmp_path / "demo").exists()


def test_rollouts_run_in_the_worker_or_the_server_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        demo(tmp_path, mode="self", rollouts="gpu")
    assert refused.value.code == "config_invalid"
    assert not (tmp_path / "demo").exists()
    result = CliRunner().invoke(app, ["demo", "--mode", "self", "--rollouts", "gpu"])
    assert result.exit_code == 2 and "--rollouts" in result.output


def test_hints_are_for_self_mode_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only --mode self takes them"):
        demo(tmp_path, mode="oracle", hints="checker")


def test_self_mode_refuses_a_training_config_that_takes_edits(tmp_path: Path) -> None:
    assert load_config(RLOO_CONFIG).own_evidence_only
    assert not load_config(CPU_CONFIG).own_evidence_only
    assert load_config(RLOO_CONFIG).sources == ["rollout", "feedback"]
    assert demo_settings(Settings(home=tmp_path), "self").training_config == RLOO_CONFIG
    edits = Settings(home=tmp_path, training_config=CPU_CONFIG)
    with pytest.raises(ConfigError, match=r"own evidence only.*lora-cpu\.yaml takes edits"):
        demo_settings(edits, "self")
    assert demo_settings(edits, "oracle").training_config == CPU_CONFIG


def test_the_command_line_names_the_hint_modes() -> None:
    result = CliRunner().invoke(app, ["demo", "--mode", "self", "--hints", "reference"])
    assert result.exit_code == 2
    assert "--hints" in result.output and "none" in result.output and "checker" in result.output


def test_a_budget_below_one_group_of_samples_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"budget 4 must be from --samples \(8\) to 64"):
        demo(tmp_path, mode="self", samples=8, budget=4)
    assert not (tmp_path / "demo").exists()
    result = CliRunner().invoke(app, ["demo", "--mode", "self", "--budget", "65"])
    assert result.exit_code == 2 and "--budget" in result.output
