"""A demo's generation table shows every decided run's p-values: the gain test's and each
guarded suite's non-inferiority test's, as the evaluation recorded them; its tables show the
no-call rate beside the call accuracy, and the outside measure."""

from __future__ import annotations

from rich.console import Console

from macaron.demo.output import demo_table, generation_table
from macaron.demo.records import DemoReport, GenerationRecord, RunRecord


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


def test_the_no_call_rate_is_shown_beside_the_call_accuracy() -> None:
    """In the demo's table (a column each, ``-`` where a generation has none), in a
    generation's caption and beside each run's candidate and parent."""
    calls = {"calls": 0.62, "no_call": 0.94}
    generations = [
        GenerationRecord(0, "rel-0", "harness@0", {"agent": 0.1}),
        GenerationRecord(
            1,
            "rel-1",
            "harness@0",
            {"agent": 0.5},
            calls=calls,
            runs=[run(candidate_calls=calls, parent_calls={"calls": 0.1, "no_call": 1.0})],
        ),
    ]
    console = Console(width=250, record=True)
    console.print(demo_table(DemoReport("contract-5", generations, "test")))
    table = " ".join(console.export_text().replace("│", " ").split())
    assert "calls: tool calls right; no call: no call where none is asked" in table
    assert "0.50 0.62 0.94" in table and "0.10 - -" in table
    shown = " ".join(rendered(generations[1]).split())
    assert "tool calls right 0.62; no call where none is asked 0.94" in shown
    assert "tool calls right 0.10; no call where none is asked 1.00" in shown


def test_the_outside_measure_is_a_column_of_its_own_and_in_each_caption() -> None:
    generations = [
        GenerationRecord(0, "rel-0", "harness@0", {"agent": 0.1}, outside=0.31),
        GenerationRecord(1, "rel-1", "harness@0", {"agent": 0.5}),  # not measured
    ]
    console = Console(width=250, record=True)
    console.print(demo_table(DemoReport("contract-5", generations, "test")))
    table = " ".join(console.export_text().replace("│", " ").split())
    assert "outside: no call on BFCL's requests no tool serves" in table
    assert "0.10 0.31" in table and "0.50 -" in table
    shown = " ".join(rendered(generations[0]).split())
    assert "outside measure (BFCL, no call where no tool serves) 0.31" in shown
    assert "outside measure" not in " ".join(rendered(generations[1]).split())
