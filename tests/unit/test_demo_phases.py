"""A demo generation's phases come from the registry's times, not from when the demo looked."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from macaron.demo.records import RunRecord, phase_seconds

T0 = datetime(2026, 12, 5, 9, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def run(run_id: str, half: str) -> RunRecord:
    return RunRecord(run_id, "agent", half, "lora-rloo", "promoted", True, 100.0, {}, {}, [])


def test_a_run_decided_while_the_traffic_rolled_on_counts_from_its_queueing() -> None:
    """The agent run is queued at 300 s and decided at 500 s, while the rollouts already
    queued go on to 640 s; its harness proposal is decided at 700 s; measuring starts at
    705 s and ends at 730 s."""
    runs = [run("a", "adapter"), run("h", "harness")]
    times = {"a": (at(300), at(500)), "h": (at(500), at(700))}
    phases = phase_seconds(T0, runs, times, measuring=at(705), ended=at(730))
    assert phases == {
        "traffic": 300.0,
        "adapter runs": 200.0,
        "harness proposals": 200.0,
        "measure": 30.0,  # from the last decision: the demo saw it 5 s later
    }
    assert sum(phases.values()) == 730.0


def test_phases_without_runs_and_with_a_run_queued_before_the_generation() -> None:
    assert phase_seconds(T0, [], {}, measuring=at(90), ended=at(100)) == {
        "traffic": 90.0,
        "adapter runs": 0.0,
        "harness proposals": 0.0,
        "measure": 10.0,
    }
    early = {"a": (at(-50), at(120))}  # queued in the generation before, decided in this one
    assert phase_seconds(T0, [run("a", "adapter")], early, at(130), at(140)) == {
        "traffic": 0.0,
        "adapter runs": 120.0,
        "harness proposals": 0.0,
        "measure": 20.0,
    }
