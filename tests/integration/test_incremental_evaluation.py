"""Incremental evaluation on the local engine and a real (tiny) model: the tasks of the
specialists a candidate leaves alone answer the same in any batch, so inheriting the parent's
outcomes on them gives what a full run of the candidate gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

from core.contract import decide
from core.harness.artifact import HarnessVersion, root_harness
from engines.local import LocalEngine
from learners.contract_runner import CONTRACT_V2, judge, load_contract, run_contract
from tests.factories import make_adapter

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TASKS_PER_SUITE = 8


def test_incremental_and_full_evaluation_agree_on_the_local_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    full_contract = load_contract(CONTRACT_V2)
    contract = full_contract.model_copy(
        update={"suites": {s: t[:TASKS_PER_SUITE] for s, t in full_contract.suites.items()}}
    )
    root = root_harness()
    enforcing = {  # well-formed by construction: outcomes vary by content, not by form alone
        name: own.model_copy(update={"enforce_grammar": True})
        for name, own in root.specialists.items()
    }
    spec = root.model_copy(update={"specialists": enforcing})
    harness = HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    parent = {"chat": "chat@1", "coding": "coding@1", "agent": "agent@1", "genui": "genui@1"}
    candidate = {**parent, "genui": "genui@2"}
    engine = LocalEngine(tiny_model)
    try:
        for seed, name in enumerate(sorted({*parent.values(), *candidate.values()})):
            folder = make_adapter(
                tiny_model, tmp_path / name.replace("@", "-"), 8, ALL_LINEAR, seed
            )
            engine.load_adapter(name, str(folder))
        before = asyncio.run(run_contract(engine, parent, contract, harness=harness))
        full = asyncio.run(run_contract(engine, candidate, contract, harness=harness))
        verdict = asyncio.run(
            judge(
                engine,
                candidate,
                contract,
                harness=harness,
                parent=before,
                changed=frozenset({"genui"}),
                specialist="genui",
            )
        )
    finally:
        engine.close()
    incremental = verdict.run
    assert (incremental.passed, incremental.well_formed) == (full.passed, full.well_formed)
    assert verdict.decision == decide(full.complete(), before.complete(), "genui", contract.rule)
    for suite, tasks in contract.suites.items():
        assert incremental.inherited[suite] == [t.specialist != "genui" for t in tasks]
    assert any(t.specialist == "genui" for tasks in contract.suites.values() for t in tasks)
    assert verdict.tasks_run == sum(
        t.specialist == "genui" for tasks in contract.suites.values() for t in tasks
    )
