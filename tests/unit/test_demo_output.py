"""A demo's generation table shows every decided run's p-values: the gain test's and each
guarded suite's non-inferiority test's, as the evaluation recorded them."""

from __future__ import annotations

from rich.console import Console

from macaron.demo.output import generation_table
from macaron.demo.records import GenerationRecord, RunRecord


def rendered(record: GenerationRecord) -> str:
    console = Console(width=200, record=True)
    console.print(generation_table(record))
    return console.export_text()


def run(**fields: object) -> RunRecord:
    base: dict[str, object] = {
        "run_id": "r1",
        "specialist": "genui",
        "half": "adapter",
        "recipe": "lora-rloo",
        "outcome": "promoted",
        "passed": True,
        "training_seconds": 12.0,
        "candidate": {"genui": 0.3},
        "parent": {"genui": 0.1},
        "reasons": [],
    }
    return RunRecord(**{**base, **fields})  # type: ignore[arg-type]


def test_a_decided_run_shows_its_p_values() -> None:
    record = GenerationRecord(
        1,
        "rel-1",
        "harness@0",
        {"genui": 0.3},
        runs=[run(p_value=0.0021, guard_p_values={"general": 0.0134, "chat": 0.5})],
    )
    text = rendered(record)
    assert "gain p = 0.0021; chat non-inferior p = 0.5000; general non-inferior p = 0.0134" in (
        " ".join(text.split())
    )


def test_a_run_not_evaluated_shows_no_p_value() -> None:
    record = GenerationRecord(
        1,
        "rel-1",
        "harness@0",
        {"genui": 0.1},
        runs=[run(outcome="training failed", passed=False, reasons=["boom"])],
    )
    assert "p =" not in rendered(record)
