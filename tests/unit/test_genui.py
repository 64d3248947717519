"""The GenUI catalogue genui-1: what validates, the path-level errors for what does not, the text
fallback shown instead of an invalid tree, and the interactive ids a ``ui_event`` may name."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import JsonValue

from core.harness.genui import (
    CATALOGUE_VERSION,
    GenUIResult,
    catalogue_schema,
    interactive_ids,
    parse_genui_output,
    text_fallback,
    validate_tree,
)

COMPONENT_TYPES = (
    "Card",
    "Text",
    "Heading",
    "Button",
    "List",
    "Table",
    "Form",
    "Input",
    "Select",
    "Chart",
)


def full_tree() -> dict[str, Any]:
    """One of every component, nested as the specialist would nest them."""
    return {
        "type": "Card",
        "id": "report",
        "title": "Quarterly report",
        "children": [
            {"type": "Heading", "text": "Sales by region"},
            {"type": "Text", "text": "North grew fastest."},
            {"type": "List", "items": ["North", "South"], "ordered": True},
            {
                "type": "Table",
                "columns": ["Region", "Units", "Share", "Target met", "Note"],
                "rows": [["North", 120, 0.6, True, None], ["South", 80, 0.4, False, "late"]],
            },
            {
                "type": "Chart",
                "kind": "bar",
                "labels": ["Q1", "Q2"],
                "series": [{"name": "North", "values": [50, 70.5]}],
            },
            {
                "type": "Card",
                "children": [
                    {
                        "type": "Form",
                        "id": "filter",
                        "children": [
                            {"type": "Heading", "text": "Filter", "level": 3},
                            {"type": "Input", "id": "search", "label": "Search"},
                            {
                                "type": "Select",
                                "id": "region",
                                "label": "Region",
                                "options": ["North", "South"],
                                "value": "North",
                            },
                            {"type": "Text", "text": "Pick a region."},
                        ],
                    },
                    {"type": "Button", "id": "export", "label": "Export"},
                ],
            },
        ],
    }


def card(*children: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Card", "children": list(children)}


def test_a_tree_with_every_component_validates_and_round_trips() -> None:
    result = validate_tree(full_tree())
    assert result == GenUIResult(valid=True, tree=result.tree, errors=[])
    assert result.tree is not None
    dumped = json.dumps(result.tree)
    assert all(f'"type": "{name}"' in dumped for name in COMPONENT_TYPES)
    assert validate_tree(result.tree) == result
    assert parse_genui_output(dumped) == result


def test_defaults_are_filled_and_nulls_left_out_except_table_cells() -> None:
    tree = card(
        {"type": "Heading", "text": "h"},
        {"type": "Button", "id": "go", "label": "Go"},
        {"type": "List", "items": []},
        {"type": "Form", "id": "f", "children": [{"type": "Input", "id": "i", "label": "I"}]},
        {"type": "Table", "id": None, "columns": ["a"], "rows": [[None]]},
    )
    result = validate_tree(tree)
    assert result.valid, result.errors
    assert result.tree == card(
        {"type": "Heading", "text": "h", "level": 2},
        {"type": "Button", "id": "go", "label": "Go", "action": "click"},
        {"type": "List", "items": [], "ordered": False},
        {
            "type": "Form",
            "id": "f",
            "children": [{"type": "Input", "id": "i", "label": "I"}],
            "submit_label": "Submit",
        },
        {"type": "Table", "columns": ["a"], "rows": [[None]]},
    )


@pytest.mark.parametrize(
    ("child", "error"),
    [
        ({"type": "Text"}, "children.0.text: Field required"),
        ({"type": "Text", "text": 5}, "children.0.text: Input should be a valid string"),
        (
            {"type": "Text", "text": "hi", "colour": "red"},
            "children.0.colour: Extra inputs are not permitted",
        ),
        (
            {"type": "Table", "columns": ["a", "b"], "rows": [["x", 1], ["y", 2, 3]]},
            "children.0.rows.1: row has 3 cells; the table has 2 columns",
        ),
        (
            {"type": "Table", "columns": ["a"], "rows": [[{"nested": 1}]]},
            "children.0.rows.0.0: cell must be a string, a finite number, a boolean or null",
        ),
        (
            {
                "type": "Chart",
                "kind": "line",
                "labels": ["a", "b"],
                "series": [{"name": "ok", "values": [1, 2]}, {"name": "short", "values": [1]}],
            },
            "children.0.series.1: series has 1 values; the chart has 2 labels",
        ),
        (
            {"type": "Select", "id": "s", "label": "S", "options": ["a", "b"], "value": "c"},
            "children.0.value: value is not one of the options",
        ),
        ({"type": "Button", "label": "Go"}, "children.0.id: Field required"),
        (
            {"type": "Heading", "text": "h", "level": 5},
            "children.0.level: Input should be less than or equal to 4",
        ),
        (
            {"type": "Form", "id": "f", "children": [{"type": "Button", "id": "b", "label": "B"}]},
            "children.0.children.0: Input tag 'Button' found using 'type' does not match any of "
            "the expected tags: 'Input', 'Select', 'Text', 'Heading'",
        ),
    ],
)
def test_each_kind_of_error_is_reported_at_its_json_path(child: dict[str, Any], error: str) -> None:
    result = validate_tree(card(child))
    assert result == GenUIResult(valid=False, tree=None, errors=[error])


def test_an_unknown_type_names_the_path_and_the_tag() -> None:
    nested = validate_tree(card({"type": "Video", "src": "x"}))
    root = validate_tree({"type": "Video"})
    assert nested.errors[0].startswith("children.0: Input tag 'Video' found")
    assert root.errors[0].startswith("tree: Input tag 'Video' found")


def test_ids_must_match_the_pattern_and_be_unique_in_the_tree() -> None:
    bad_id = validate_tree(card({"type": "Button", "id": "9lives", "label": "x"}))
    duplicate = validate_tree(
        card(
            {"type": "Button", "id": "save", "label": "Save"},
            card({"type": "Input", "id": "save", "label": "Name"}),
        )
    )
    assert bad_id.errors[0].startswith("children.0.id: String should match pattern")
    assert duplicate.errors == [
        "children.1.children.0.id: duplicate id 'save'; first used at children.0.id"
    ]


def test_a_tree_5000_cards_deep_is_refused_without_recursing() -> None:
    tree: dict[str, Any] = card()
    for _ in range(4999):
        tree = card(tree)
    text = "".join(['{"type": "Card", "children": ['] * 5000) + "]}" * 5000
    assert validate_tree(tree).errors == ["tree is nested deeper than 12"]
    assert parse_genui_output(text).valid is False


def test_twelve_levels_are_allowed() -> None:
    tree: dict[str, Any] = card()
    for _ in range(11):
        tree = card(tree)
    assert validate_tree(tree).valid
    assert validate_tree(card(tree)).errors == ["tree is nested deeper than 12"]


def test_more_than_300_components_are_refused() -> None:
    tree = card(*(card(*({"type": "Text", "text": "t"} for _ in range(50))) for _ in range(7)))
    assert validate_tree(tree).errors == ["tree has 358 components; at most 300"]


def test_errors_are_capped_at_20() -> None:
    result = validate_tree(card(*({"type": "Text"} for _ in range(50))))
    assert len(result.errors) == 20
    assert result.errors[19] == "children.19.text: Field required"


@pytest.mark.parametrize("value", [[full_tree()], "Card", 42, None])
def test_anything_but_an_object_is_refused(value: object) -> None:
    assert validate_tree(value).errors == ["tree must be a JSON object with a type"]


def test_output_that_is_not_json_is_refused() -> None:
    result = parse_genui_output('{"type": "Card", "children": [')
    assert result.valid is False
    assert len(result.errors) == 1
    assert result.errors[0].startswith("output is not JSON: ")


@pytest.mark.parametrize(
    "fence", ["```json\n{}\n```", "```\n{}\n```", "  ```json\n{}```\n", "\n {} \n"]
)
def test_fenced_or_padded_output_parses(fence: str) -> None:
    tree = full_tree()
    result = parse_genui_output(fence.replace("{}", json.dumps(tree, indent=2)))
    assert result == validate_tree(tree)
    assert result.valid


def test_the_catalogue_schema_names_every_component() -> None:
    schema = catalogue_schema()
    assert schema["title"] == f"Macaron GenUI catalogue {CATALOGUE_VERSION}"
    assert CATALOGUE_VERSION == "genui-1"
    assert set(COMPONENT_TYPES) <= set(schema["$defs"])
    json.dumps(schema)


def test_the_text_fallback_shows_the_problem_and_the_text_but_no_tree() -> None:
    tree = full_tree()
    tree["children"][0]["level"] = 9
    raw = f"```json\n{json.dumps(tree)}\n```"
    result = parse_genui_output(raw)
    shown = text_fallback(raw, result)
    assert shown.startswith(
        "I could not render that view (1 problem: children.0.level: Input should be less than "
        "or equal to 4). Here is the answer as text:\n"
    )
    body = shown.split("\n", 1)[1]
    for fragment in ("{", "}", "[", '"type"', "children", "Card", "export"):
        assert fragment not in body
    for text in ("Quarterly report", "North grew fastest.", "late", "120", "Export"):
        assert text in body


def test_the_text_fallback_reads_truncated_json_and_keeps_prose() -> None:
    truncated = '{"type": "Card", "children": [{"type": "Text", "text": "Half an \\"answer\\""'
    prose = "Sales rose 5% {roughly}. " * 200
    shown_truncated = text_fallback(truncated, parse_genui_output(truncated))
    shown_prose = text_fallback(prose, parse_genui_output(prose))
    assert shown_truncated.endswith('Here is the answer as text:\nHalf an "answer"')
    header, body = shown_prose.split("\n", 1)
    assert header.startswith("I could not render that view (1 problem: output is not JSON: ")
    assert body == prose.strip()[:2000]


def test_interactive_ids_finds_nested_buttons_forms_inputs_and_selects() -> None:
    result = validate_tree(full_tree())
    assert result.tree is not None
    tree: dict[str, JsonValue] = result.tree
    assert interactive_ids(tree) == {
        "filter": "Form",
        "search": "Input",
        "region": "Select",
        "export": "Button",
    }
