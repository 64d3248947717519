"""Incremental evaluation: a candidate runs only the tasks of the specialists its change can
touch and inherits its parent's outcomes on the rest, reaching the same per-task outcomes and
the same decision as a full run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from core.contract import decide
from core.engine import GenerationChunk, GenerationRequest
from core.harness.actions import TOOLS
from core.harness.artifact import HarnessSpec, HarnessVersion, root_version
from core.harness.hcp import build_context
from core.release import AdapterRef, Release, changed_specialists
from engines.instant import InstantEngine
from learners.evaluation.contract_runner import (
    CONTRACT_V2,
    Baseline,
    judge,
    load_contract,
    run_contract,
)
from tests.factories import root_release

CONTRACT = load_contract(CONTRACT_V2)
SPECIALISTS = tuple(CONTRACT.specialists())
ADAPTERS = {name: f"{name}@0" for name in SPECIALISTS}
ROOT = root_version()
NEW_GENUI_PROMPT = "You answer with one GenUI component tree, and only that."


def _harness(version: int, spec: HarnessSpec) -> HarnessVersion:
    return HarnessVersion(version=version, sha256=spec.address, parent_version=0, spec=spec)


def _genui_prompt_changed() -> HarnessVersion:
    specialists = dict(ROOT.spec.specialists)
    specialists["genui"] = specialists["genui"].model_copy(
        update={"system_prompt": NEW_GENUI_PROMPT}
    )
    return _harness(1, ROOT.spec.model_copy(update={"specialists": specialists}))


def _coding(root: Release) -> dict[str, AdapterRef]:
    return {"coding": root.adapters["coding"].model_copy(update={"version": 1, "sha256": "1" * 64})}


def test_the_changed_specialists_are_those_whose_adapter_or_harness_entry_differs() -> None:
    root = root_release(*SPECIALISTS)
    harness = _genui_prompt_changed()
    changed = changed_specialists((root, ROOT), (root.successor(harness=harness), harness))
    assert changed == frozenset({"genui"})
    coding = root.successor(adapters=_coding(root))
    assert changed_specialists((root, ROOT), (coding, ROOT)) == frozenset({"coding"})
    assert changed_specialists((root, ROOT), (root, ROOT)) == frozenset()


def test_a_change_every_specialist_sees_is_evaluated_in_full() -> None:
    root = root_release(*SPECIALISTS)
    fewer_tools = _harness(1, ROOT.spec.model_copy(update={"tools": TOOLS[:1]}))
    assert (
        changed_specialists((root, ROOT), (root.successor(harness=fewer_tools), fewer_tools))
        is None
    )
    other_base = root.model_copy(update={"base_model": "other"})
    assert changed_specialists((root, ROOT), (other_base, ROOT)) is None
    fewer = root.model_copy(update={"adapters": {"chat": root.adapters["chat"]}})
    assert changed_specialists((root, ROOT), (fewer, ROOT)) is None


class _Answering(InstantEngine):
    """Answers a task with its reference when its specialist's prompt says so (chat and coding
    under any harness, genui only under the changed prompt), else "nope"; records what it
    served."""

    def __init__(self) -> None:
        self.served: list[str] = []
        answers: dict[tuple[str, str], str] = {}
        for harness in (ROOT, _genui_prompt_changed()):
            for task in (t for tasks in CONTRACT.suites.values() for t in tasks):
                messages = build_context(harness, task.specialist, [], task.prompt).messages()
                right = task.specialist in ("chat", "coding") or (
                    harness is not ROOT and task.specialist == "genui"
                )
                answers[(messages[0]["content"], messages[-1]["content"])] = (
                    task.reference if right else "nope"
                )
        super().__init__(lambda m: answers[(m[0]["content"], m[-1]["content"])])
        for adapter in ADAPTERS.values():
            self.load_adapter(adapter, "unused")

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        self.served.append(request.request_id.removeprefix("contract-"))
        return super().generate(request)


def test_incremental_and_full_evaluation_agree_on_every_task_and_the_decision() -> None:
    candidate = _genui_prompt_changed()
    root = root_release(*SPECIALISTS)
    changed = changed_specialists((root, ROOT), (root.successor(harness=candidate), candidate))
    assert changed == frozenset({"genui"})
    parent = asyncio.run(run_contract(_Answering(), ADAPTERS, CONTRACT, harness=ROOT))
    full = asyncio.run(run_contract(_Answering(), ADAPTERS, CONTRACT, harness=candidate))
    engine = _Answering()
    verdict = asyncio.run(
        judge(
            engine,
            ADAPTERS,
            CONTRACT,
            candidate,
            Baseline(parent, changed, "genui"),
        )
    )
    incremental = verdict.run
    assert (incremental.passed, incremental.well_formed) == (full.passed, full.well_formed)
    assert full.passed != parent.passed  # the change shows, so inheriting the wrong task would
    assert any(any(done) for done in parent.passed.values())  # and the parent's outcomes vary
    genui_tasks = {
        t.id for tasks in CONTRACT.suites.values() for t in tasks if t.specialist == "genui"
    }
    assert sorted(engine.served) == sorted(genui_tasks)  # nothing else ran
    for suite, tasks in CONTRACT.suites.items():
        assert incremental.inherited[suite] == [t.specialist != "genui" for t in tasks]
    assert not any(any(flags) for flags in full.inherited.values())
    assert verdict.decision == decide(full.complete(), parent.complete(), "genui", CONTRACT.rule)
    assert verdict.decision.passed  # genui answers right under the changed prompt only
