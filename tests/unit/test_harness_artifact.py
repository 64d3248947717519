"""The harness as data: its address, harness@0, the context it builds, and the typed errors
for a harness this server cannot serve."""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import HarnessInvalid, HarnessNotFound, HcpUnsupported
from core.events import ChatMessage
from core.harness.actions import TOOLS
from core.harness.artifact import (
    MAX_EXEMPLAR_CHARS,
    MAX_EXEMPLARS,
    Decoding,
    Exemplar,
    HarnessSpec,
    HarnessVersion,
    harness_diff,
    harness_from,
    harness_number,
    root_harness,
    root_version,
)
from core.harness.hcp import build_context
from tests.factories import root_release

ROOT_ADDRESS = "a0c5bf7888d3c6f6984a10c697f6577a73ce3c2fd78cc22332beed3814a4bfd4"
"""harness@0's address. Databases hold it: harness@0 must never change (a change is a new
harness version, proposed and promoted like any other)."""


def _with(spec: HarnessSpec, specialist: str, **update: Any) -> HarnessSpec:
    changed = spec.specialists[specialist].model_copy(update=update)
    return spec.model_copy(update={"specialists": {**spec.specialists, specialist: changed}})


def test_the_root_harness_has_a_stable_address() -> None:
    assert root_harness().address == root_harness().address == ROOT_ADDRESS
    assert root_version().name == "harness@0" and root_version().sha256 == ROOT_ADDRESS


def test_the_address_changes_with_any_field() -> None:
    root = root_harness()
    variants = [
        root,
        _with(root, "chat", system_prompt="Be brief."),
        _with(root, "chat", exemplars=(Exemplar(user="hi", assistant="hello"),)),
        _with(root, "chat", exemplars=(Exemplar(user="hi", assistant="hello!"),)),
        _with(root, "agent", output=("tool_call", "text")),
        _with(root, "genui", enforce_grammar=True),
        _with(root, "coding", decoding=Decoding(temperature=0.2)),
        _with(root, "coding", decoding=Decoding(top_p=0.9)),
        _with(root, "coding", decoding=Decoding(max_new_tokens=128)),
        root.model_copy(update={"tools": TOOLS[:2]}),
    ]
    assert len({v.address for v in variants}) == len(variants)


def test_the_root_harness_builds_the_contexts_the_server_built_before_harnesses_were_data() -> None:
    root = root_version()
    chat = build_context(root, "chat", [], "hi").messages()
    assert chat == [
        {"role": "system", "content": "You are Macaron, a helpful, concise assistant."},
        {"role": "user", "content": "hi"},
    ]
    agent = build_context(root, "agent", [], "what is 2+2?")
    assert agent.grammars == ("text", "tool_call") and agent.tools == TOOLS
    assert agent.messages()[0]["content"].startswith("You are Macaron's agent. You can use tools.")
    assert "\nTools: calculator: " in agent.messages()[0]["content"]
    genui = build_context(root, "genui", [], "a login form")
    assert genui.grammars == ("genui",) and genui.genui_catalogue == "genui-1"
    assert "\nComponents (each an object with a type)" in genui.messages()[0]["content"]
    coding = build_context(root, "coding", [], "sort a list")
    assert coding.grammars == ("text",) and coding.tools == () and coding.genui_catalogue is None
    other = build_context(root, "math", [], "2+2")  # a specialist it does not name: chat's
    assert other.system_prompt == chat[0]["content"] and other.grammars == ("text",)
    assert {c.harness_version for c in (agent, genui, coding)} == {"harness@0"}
    assert all(not s.enforce_grammar for s in root.spec.specialists.values())


def test_exemplars_come_before_the_history() -> None:
    spec = _with(root_harness(), "chat", exemplars=(Exemplar(user="2+2?", assistant="4"),))
    harness = HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    history = [ChatMessage(role="user", content="a"), ChatMessage(role="assistant", content="b")]
    messages = build_context(harness, "chat", history, "c").messages()
    assert [m["content"] for m in messages[1:]] == ["2+2?", "4", "a", "b", "c"]


def _spec(**change: Any) -> dict[str, Any]:
    return {**root_harness().model_dump(mode="json"), **change}


def _chat(**change: Any) -> dict[str, Any]:
    data = _spec()
    data["specialists"]["chat"].update(change)
    return data


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (_spec(hcp_version="hcp-2"), HcpUnsupported),
        (_spec(catalogue_version="genui-9"), HarnessInvalid),
        (
            _spec(tools=[{"name": "teleport", "description": "go", "parameters": {}}]),
            HarnessInvalid,
        ),
        (_spec(tools=[]), HarnessInvalid),  # the agent may call tools, but there are none
        (_spec(specialists={}), HarnessInvalid),
        (_spec(surprise=1), HarnessInvalid),
        (_chat(exemplars=[{"user": "q", "assistant": "a"}] * (MAX_EXEMPLARS + 1)), HarnessInvalid),
        (
            _chat(exemplars=[{"user": "q" * (MAX_EXEMPLAR_CHARS + 1), "assistant": "a"}]),
            HarnessInvalid,
        ),
        (_chat(output=["text", "text"]), HarnessInvalid),
        (_chat(output=["markdown"]), HarnessInvalid),
        (_chat(decoding={"temperature": 3.0}), HarnessInvalid),
        (_chat(system_prompt=""), HarnessInvalid),
        (_chat(tool_choice="required"), HarnessInvalid),  # chat has no tool_call output
        (_chat(tool_choice="always"), HarnessInvalid),
    ],
)
def test_a_harness_this_server_cannot_serve_is_a_typed_error(
    data: dict[str, Any], error: type[HarnessInvalid]
) -> None:
    with pytest.raises(error) as raised:
        harness_from(data)
    assert type(raised.value) is error
    assert raised.value.code == (
        "hcp_unsupported" if error is HcpUnsupported else "harness_invalid"
    )


def test_a_valid_harness_parses_back_to_itself() -> None:
    assert harness_from(root_harness().model_dump(mode="json")) == root_harness()
    data = _spec()
    data["specialists"]["agent"]["tool_choice"] = "required"
    required = harness_from(data)
    assert required.specialists["agent"].tool_choice == "required"
    assert harness_from(required.model_dump(mode="json")) == required
    assert required.address != root_harness().address


def test_harness_references() -> None:
    assert harness_number("harness@3") == 3
    assert harness_number("harness-1") == 0  # releases from before harnesses were data
    with pytest.raises(HarnessNotFound):
        harness_number("harness@x")


def test_the_diff_names_each_changed_field() -> None:
    root = root_harness()
    new = _with(
        _with(root, "coding", system_prompt="Be terse."),
        "genui",
        enforce_grammar=True,
        exemplars=(Exemplar(user="a form", assistant="{}"),),
    )
    changes = harness_diff(root, new)
    assert [path for path, _, _ in changes] == [
        "specialists.coding.system_prompt",
        "specialists.genui.enforce_grammar",
        "specialists.genui.exemplars",
        "specialists.genui.exemplars.0.assistant",
        "specialists.genui.exemplars.0.user",
    ]
    assert changes[1][1:] == ("false", "true")
    assert harness_diff(root, root) == []


def test_a_successor_may_change_the_adapters_the_harness_or_both() -> None:
    root = root_release("chat")
    spec = _with(root_harness(), "chat", system_prompt="Be brief.")
    harness = HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    chat1 = root.adapters["chat"].model_copy(update={"version": 1, "sha256": "1" * 64})
    harness_only = root.successor(harness=harness)
    adapter_only = root.successor(adapters={"chat": chat1})
    both = root.successor(adapters={"chat": chat1}, harness=harness)
    assert harness_only.adapters == root.adapters and harness_only.harness_version == "harness@1"
    assert adapter_only.harness_version == "harness@0" and adapter_only.adapters["chat"] == chat1
    assert both.harness_version == "harness@1" and both.adapters["chat"] == chat1
    ids = {r.release_id for r in (root, harness_only, adapter_only, both)}
    assert len(ids) == 4 and harness_only.parent_release_id == "r0"
    assert root.successor(harness=harness).release_id == harness_only.release_id
