"""Sealed contract versions: each shipped version's content (per task its content hash, per
routing file its hash) in ``CONTRACT_SEALS``, and loading a version whose content differs
refused (``ContractChanged``, naming what changed): a changed task needs a new version, or two
different tasks would be scored as one."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from core.canonical import sha256_hex
from core.contract import Contract
from core.errors import ContractChanged, ContractInvalid
from learners.files import DATA

CONTRACT_SEALS = DATA / "contract-seals.json"
"""Each shipped contract version's content as it was sealed: per task id its content hash,
and per routing file its hash."""


def seal(path: Path, contract: Contract) -> dict[str, str]:
    """What a contract version is sealed with: each task's content hash by id, and each
    routing file's hash (``routing:<file>``)."""
    content = {
        task.id: task.key().split(":", 1)[1] for tasks in contract.suites.values() for task in tasks
    }
    if contract.routing is not None:
        for name in filter(None, (contract.routing.suite, contract.routing.follow_ups)):
            content[f"routing:{name}"] = sha256_hex((path.parent / name).read_bytes())
    return content


def check_sealed(path: Path, contract: Contract) -> None:
    """``ContractChanged`` naming every task (or routing file) of a sealed version whose
    content is not what the version was sealed with."""
    sealed = _seals().get(contract.version)
    if sealed is None:
        return
    content = seal(path, contract)
    changed = sorted(
        name for name in sealed.keys() | content.keys() if sealed.get(name) != content.get(name)
    )
    if changed:
        raise ContractChanged(
            f"{path}: {contract.version} is sealed, and these of its tasks differ from the "
            f"sealed ones: {', '.join(changed)}; a changed task needs a new contract version"
        )


@functools.cache
def _seals() -> dict[str, dict[str, str]]:
    try:
        seals: dict[str, dict[str, str]] = json.loads(CONTRACT_SEALS.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ContractInvalid(f"{CONTRACT_SEALS}: cannot be read: {exc}") from exc
    return seals
