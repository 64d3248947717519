"""Incremental evaluation on the local engine and a real (tiny) model: the tasks of the
specialists a candidate leaves alone answer the same in any batch, so inheriting the parent's
outcomes on them gives what a full run of the candidate gives, and training one specialist
leaves the others' answers as they were."""

from __future__ import annotations

import asyncio
from pathlib import Path

from core.contract import decide
from core.events import ChatMessage
from core.harness.artifact import HarnessVersion, root_harness, root_version
from engines.local.engine import LocalEngine
from learners.evaluation.contract_runner import (
    CONTRACT_V2,
    CONTRACT_V3,
    Baseline,
    answers,
    judge,
    load_contract,
    run_contract,
)
from learners.recipes.config import Examples, SFTExample, TrainingConfig
from learners.recipes.lora import train_successor_adapter
from learners.tasks import load_bank
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
                harness,
                Baseline(before, frozenset({"genui"}), "genui"),
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


def test_training_one_specialist_leaves_the_others_answers_token_identical(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Gains that carry: a genui successor trained by the recipe (fixed seed) changes genui's
    answers and no other specialist's, token for token, on every suite (the general suite's
    chat, agent and coding tasks too), all served in one mixed batch as the contract is."""
    full_contract = load_contract(CONTRACT_V3)
    contract = full_contract.model_copy(
        update={"suites": {s: t[:TASKS_PER_SUITE] for s, t in full_contract.suites.items()}}
    )
    parent = {name: f"{name}@1" for name in ("chat", "coding", "agent", "genui")}
    folders = {
        name: make_adapter(tiny_model, tmp_path / name.replace("@", "-"), 8, ALL_LINEAR, seed)
        for seed, name in enumerate(sorted(parent.values()))
    }
    genui = [t for t in load_bank() if t.specialist == "genui"][:8]
    sft = [
        SFTExample(messages=[ChatMessage(role="user", content=t.prompt)], target=t.reference)
        for t in genui
    ]
    config = TrainingConfig(steps=4, batch_size=4, learning_rate=0.05, max_length=256)
    trained = train_successor_adapter(
        tiny_model, folders["genui@1"], tmp_path / "genui-2", Examples(sft=sft), config
    )
    assert trained.examples == len(sft)
    candidate = {**parent, "genui": "genui@2"}
    keys = [(suite, i) for suite, tasks in contract.suites.items() for i in range(len(tasks))]
    engine = LocalEngine(tiny_model)
    try:
        for name, folder in {**folders, "genui@2": tmp_path / "genui-2"}.items():
            engine.load_adapter(name, str(folder))
        before = asyncio.run(answers(engine, parent, contract, keys, harness=root_version()))
        after = asyncio.run(answers(engine, candidate, contract, keys, harness=root_version()))
    finally:
        engine.close()
    task = {key: contract.suites[key[0]][key[1]] for key in keys}
    others = [key for key in keys if task[key].specialist != "genui"]
    assert {t.specialist for key, t in task.items() if key in others} == {"chat", "coding", "agent"}
    assert [before[key] for key in others] == [after[key] for key in others]
    changed = [key for key in keys if task[key].specialist == "genui" and before[key] != after[key]]
    assert changed  # the successor did learn something, so the others' sameness means something
