"""JSON Merge Patch (RFC 7386): apply a patch, and compute the patch between two objects.

A harness action records its effect on the conversation's tool state as a merge patch, so the
state is rebuilt by applying the recorded patches in order. Merge patches cannot set a member to
``null`` (``null`` deletes), so ``merge_patch_diff`` refuses objects that hold ``null`` members.
"""

from __future__ import annotations

import copy
from typing import overload

from pydantic import JsonValue


@overload
def apply_merge_patch(target: JsonValue, patch: dict[str, JsonValue]) -> dict[str, JsonValue]: ...


@overload
def apply_merge_patch(target: JsonValue, patch: JsonValue) -> JsonValue: ...


def apply_merge_patch(target: JsonValue, patch: JsonValue) -> JsonValue:
    """RFC 7386 ``MergePatch(target, patch)``; the result shares no objects with either input."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(target) if isinstance(target, dict) else {}
    _merge_into(merged, patch)
    return merged


def _merge_into(target: dict[str, JsonValue], patch: dict[str, JsonValue]) -> None:
    """Merge ``patch`` into ``target``, which the caller owns and lets this change."""
    for name, value in patch.items():
        if value is None:
            target.pop(name, None)
        elif isinstance(value, dict):
            member = target.get(name)
            if not isinstance(member, dict):
                member = {}
            _merge_into(member, value)
            target[name] = member
        else:
            target[name] = copy.deepcopy(value)


def merge_patch_diff(
    before: dict[str, JsonValue], after: dict[str, JsonValue]
) -> dict[str, JsonValue]:
    """The smallest merge patch with ``apply_merge_patch(before, patch) == after``.

    Members that are objects on both sides are diffed recursively; any other change replaces the
    member whole (arrays included). Raises ``ValueError`` if ``after`` has a ``null`` member in
    an object, which no merge patch can produce.
    """
    patch: dict[str, JsonValue] = {name: None for name in before if name not in after}
    for name, new in after.items():
        old = before.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            nested = merge_patch_diff(old, new)
            if nested:
                patch[name] = nested
        elif name not in before or not _same_json(old, new):
            _require_no_null_members(new, name)
            patch[name] = copy.deepcopy(new)
    return patch


def _same_json(a: JsonValue, b: JsonValue) -> bool:
    """JSON equality: unlike ``==``, ``1``, ``1.0`` and ``true`` are three different values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _require_no_null_members(value: JsonValue, path: str) -> None:
    """Objects (not arrays) in a patch value may not hold ``null``: it would mean "delete"."""
    if value is None:
        raise ValueError(f"a merge patch cannot set {path} to null")
    if isinstance(value, dict):
        for name, member in value.items():
            _require_no_null_members(member, f"{path}.{name}")
