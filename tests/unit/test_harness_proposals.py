"""Harness successors the loop proposes: which changes apply to a specialist, in what turn, and
what each makes of the harness (and when it has nothing to make)."""

from __future__ import annotations

import uuid

import pytest

from core.events import ExperienceRecorded, ExperienceSource
from core.experience import FILTER_VERSION
from core.harness.artifact import Exemplar, harness_diff, root_harness
from core.harness.proposals import (
    EXEMPLARS,
    PROMPT_VARIANTS,
    changes,
    exemplar_of,
    next_change,
    propose,
)
from learners.recipes.config import CPU_CONFIG, RLOO_CONFIG, load_config
from learners.training.propose import exemplars

ROOT = root_harness()
TREE = '{"type": "Text", "text": "green"}'
CALL = '{"tool": "clock", "args": {}}'


def test_structured_specialists_start_with_their_grammar_and_take_changes_in_turn() -> None:
    assert changes(ROOT, "genui") == ["grammar", "exemplars", "prompt"]
    assert changes(ROOT, "agent") == ["grammar", "exemplars", "prompt"]
    assert changes(ROOT, "chat") == ["exemplars", "prompt"]  # text: no grammar to enforce
    enforcing = propose(ROOT, "agent", "grammar", examples=(), attempt=0)
    assert enforcing is not None
    assert changes(enforcing, "agent") == ["grammar", "tool_choice", "exemplars", "prompt"]
    required = propose(enforcing, "agent", "tool_choice", examples=(), attempt=0)
    assert required is not None and required.specialists["agent"].tool_choice == "required"
    assert propose(ROOT, "chat", "tool_choice", examples=(), attempt=0) is None
    assert [next_change(ROOT, "genui", n) for n in range(4)] == [
        "grammar",
        "exemplars",
        "prompt",
        "grammar",
    ]


def test_each_change_touches_one_field_of_one_specialist() -> None:
    on = propose(ROOT, "genui", "grammar", examples=(), attempt=0)
    assert on is not None
    assert [path for path, _, _ in harness_diff(ROOT, on)] == ["specialists.genui.enforce_grammar"]
    off = propose(on, "genui", "grammar", examples=(), attempt=0)
    assert off == ROOT  # grammar off again is the same content, the same address

    shown = [Exemplar(user=f"Show {n}.", assistant=TREE) for n in range(EXEMPLARS + 2)]
    taught = propose(ROOT, "genui", "exemplars", examples=shown, attempt=0)
    assert taught is not None and taught.specialists["genui"].exemplars == tuple(shown[:EXEMPLARS])
    assert {p.split(".")[2] for p, _, _ in harness_diff(ROOT, taught)} == {"exemplars"}
    assert propose(taught, "genui", "exemplars", examples=shown, attempt=0) is None  # no news
    assert propose(ROOT, "genui", "exemplars", examples=(), attempt=0) is None

    varied = propose(ROOT, "coding", "prompt", examples=(), attempt=0)
    assert varied is not None
    assert varied.specialists["coding"].system_prompt == PROMPT_VARIANTS["coding"][0]
    assert [p for p, _, _ in harness_diff(ROOT, varied)] == ["specialists.coding.system_prompt"]


def test_a_specialist_the_harness_does_not_name_gets_its_own_entry() -> None:
    spec = propose(
        ROOT, "legal", "exemplars", examples=[Exemplar(user="a", assistant="b")], attempt=0
    )
    assert spec is not None and "legal" in spec.specialists
    assert spec.specialists["legal"].system_prompt == ROOT.specialists["chat"].system_prompt


@pytest.mark.parametrize(
    ("specialist", "answer", "fits"),
    [
        ("genui", TREE, True),
        ("genui", "green", False),  # not a tree
        ("genui", '{"type": "Nope"}', False),  # not in the catalogue
        ("agent", CALL, True),
        ("agent", "It is noon.", True),
        ("agent", '{"tool": "shell", "args": {}}', False),  # no such tool
        ("chat", "Paris.", True),
        ("chat", CALL, False),  # chat calls no tools
        ("chat", "", False),
        ("chat", "x" * 5000, False),
    ],
)
def test_only_verified_answers_of_the_right_form_become_exemplars(
    specialist: str, answer: str, fits: bool
) -> None:
    found = exemplar_of(ROOT, specialist, "What now?", answer)
    assert (found is not None) == fits
    if found is not None:
        assert (found.user, found.assistant) == ("What now?", answer)


def test_no_exemplar_holds_a_tenants_words() -> None:
    """Exemplars are mined from the run's snapshot, of the sources the runs train on, and only
    from rollouts on the project's prompts: a turn's record (a tenant's words, with a thumbs-up
    or an edit) is no exemplar, in self mode (``lora-rloo.yaml``) nor where edits and feedback
    are trained on (``lora-cpu.yaml``); where rollouts are not trained on, nothing is."""

    def record(source: ExperienceSource, n: int) -> ExperienceRecorded:
        rollout = source == "rollout"
        return ExperienceRecorded(
            experience_id=uuid.uuid4(),
            kind="sft",
            specialist="genui",
            turn_id=None if rollout else uuid.uuid4(),
            rollout_group_id=uuid.uuid4() if rollout else None,
            filter_version=FILTER_VERSION,
            source=source,
            record={
                "messages": [{"role": "user", "content": f"Show {source} {n}."}],
                "target": TREE,
                "adapter_version": "genui@0",
                "release_id": None,
            },
        )

    snapshot = [record("edit", 0), record("rollout", 1), record("feedback", 2)]
    assert [record.source for record in snapshot] == ["edit", "rollout", "feedback"]
    for config in (RLOO_CONFIG, CPU_CONFIG):
        found = exemplars(snapshot, ROOT, "genui", load_config(config))
        assert [e.user for e in found] == ["Show rollout 1."], config
    turns_only = load_config(CPU_CONFIG).model_copy(update={"sources": ["feedback", "edit"]})
    assert exemplars(snapshot, ROOT, "genui", turns_only) == []
