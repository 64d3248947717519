"""Releases: ``promote`` and ``rollback`` by hand, ``lineage`` back to the root, the
``registry`` as of a moment, and ``contract run`` on one."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.table import Table

from core.errors import PromotionFailed, ReleaseNotFound
from core.settings import Settings
from infra.artifacts import ArtifactStore, load_release
from infra.postgres.lineage import (
    LineageStep,
    active_release_at,
    lineage,
    release_step,
    to_dot,
)
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.postgres.registry import active_release, harness_by_name, release_by_id
from learners.evaluation.contract_runner import (
    CALL_RATES,
    DEFAULT_CONTRACT,
    Split,
    load_split,
)
from macaron import wiring
from macaron.cli.common import console, settings

contract_app = typer.Typer(help="The external contract.", no_args_is_help=True)


def promote(
    ctx: typer.Context,
    release_id: Annotated[str, typer.Argument(help="The release to make active.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server.")] = 120.0,
) -> None:
    """Promote a release by hand: the running server loads it, checks it and flips to it."""
    await_promotion(settings(ctx), release_id, "promote", timeout)


def rollback(
    ctx: typer.Context,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server.")] = 120.0,
) -> None:
    """Make the active release's parent active again."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        parent = active_release(conn).parent_release_id
    if parent is None:
        raise ReleaseNotFound("the active release is the root: there is nothing to roll back to")
    await_promotion(cfg, parent, "rollback", timeout)


def await_promotion(cfg: Settings, release_id: str, kind: str, timeout: float) -> None:
    """Ask the running server to make ``release_id`` active and wait for its answer."""
    with wiring.pool(cfg) as pool:
        request = request_promotion(pool, release_id, kind=kind, requested_by="operator (cli)")
        final = wait_for_request(pool, request, timeout)
    if final.status == "pending":
        raise PromotionFailed(f"no server took the request in {timeout:.0f} s; is one running?")
    if final.status == "failed":
        raise PromotionFailed(f"{kind} of {release_id} refused: {final.reason}")
    how = f"; {final.reason}" if final.reason else ""
    console.print(f"{release_id} is active ({kind}{how})")


def registry(
    ctx: typer.Context,
    at: Annotated[
        datetime | None,
        typer.Option(
            help="A past moment (ISO 8601; UTC unless it names a zone). Default: now.",
            metavar="TIME",
            formats=[
                "%Y-%m-%dT%H:%M:%S.%f%z",
                "%Y-%m-%dT%H:%M:%S%z",
                "%Y-%m-%dT%H:%M:%S",
                "%Y-%m-%d",
            ],
        ),
    ] = None,
) -> None:
    """Which release was active at a moment, and what it named: adapters, harness, router."""
    moment = datetime.now(UTC) if at is None else at.replace(tzinfo=at.tzinfo or UTC)
    with wiring.pool(settings(ctx)) as pool, pool.connection() as conn:
        release_id = active_release_at(conn, moment)
        if release_id is None:
            raise ReleaseNotFound(f"no release was active at {moment.isoformat()}")
        step = release_step(conn, release_id)
        release = release_by_id(conn, release_id)
    console.print(f"active at {moment.isoformat()}: {release_id} (created {step.created_at})")
    table = Table()
    for column in ("part", "version"):
        table.add_column(column)
    for name, adapter in release.adapters.items():
        table.add_row(name, f"{adapter.name} sha256:{adapter.sha256[:12]}")
    table.add_row("harness", f"{release.harness_version} (hcp {release.hcp_version})")
    table.add_row("router", release.router_version)
    table.add_row("base model", release.base_model)
    console.print(table)


class LineageFormat(StrEnum):
    table = "table"
    json = "json"
    dot = "dot"


def lineage_of(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="A release id, or an adapter version: genui@3.")],
    output: Annotated[LineageFormat, typer.Option("--format", help="Output format.")] = (
        LineageFormat.table
    ),
) -> None:
    """Walk a release or adapter version back to the root: parents, training runs, dataset
    snapshots (log range and hash), evaluations, promotions."""
    with wiring.pool(settings(ctx)) as pool, pool.connection() as conn:
        steps = lineage(conn, ref)
    if output is LineageFormat.json:
        console.print_json(json.dumps([s.model_dump() for s in steps]))
    elif output is LineageFormat.dot:
        sys.stdout.write(to_dot(steps))
    else:
        console.print(_lineage_table(ref, steps))


def _lineage_table(ref: str, steps: list[LineageStep]) -> Table:
    table = Table(title=f"lineage of {ref}")
    for column in (
        "kind",
        "id",
        "parent",
        "created",
        "harness",
        "adapters",
        "run",
        "snapshot",
        "evaluation",
    ):
        table.add_column(column)
    for step in steps:
        harness: Any = step.detail.get("harness") or {}
        adapters: Any = step.detail.get("adapters") or {}
        run: Any = step.detail.get("run") or {}
        snapshot = run.get("snapshot") or {}
        evaluation = (run.get("evaluations") or [{}])[-1]
        table.add_row(
            step.kind,
            step.id,
            step.parent or "(root)",
            step.created_at[:19],
            f"{harness.get('name', '')} {str(harness.get('sha256', ''))[:12]}".strip(),
            " ".join(str(a).split(" ")[0] for a in adapters.values()),
            f"{run.get('run_id', '')[:8]} {run.get('status', '')}",
            _snapshot_cell(snapshot) if snapshot else "",
            f"passed={evaluation.get('passed')} {evaluation.get('candidate', '')}"
            if evaluation
            else "",
        )
    return table


def _snapshot_cell(snapshot: dict[str, Any]) -> str:
    """Records, range, hash and filter version; the backfills that replayed history into it."""
    cell = (
        f"{snapshot.get('records', '')} records {snapshot.get('start', '')}->"
        f"{snapshot.get('end', '')} {str(snapshot.get('content_hash', ''))[:12]} "
        f"{snapshot.get('filter_version', '')}"
    )
    for replayed in snapshot.get("replayed") or []:
        cell += (
            f"; replayed by backfill {str(replayed['backfill_id'])[:8]} "
            f"({replayed['filter_version']}, log {replayed['from']}->{replayed['to']})"
        )
    return cell


@contract_app.command("run")
def contract_run(
    ctx: typer.Context,
    release_id: Annotated[
        str, typer.Argument(help="The release to evaluate ('active' for the active one).")
    ] = "active",
    split: Annotated[
        Split,
        typer.Option(
            help="'test': the contract's own suites, its sealed test split (what promotions "
            "are decided on and numbers are reported on); 'development': the suites of the "
            "contract its 'development' names (what choices are made on); 'outside': 148 "
            "requests from BFCL (Apache 2.0) that none of the tools serves, written outside the "
            "project (the no-call rate is its score; never chosen or trained on)."
        ),
    ] = "test",
) -> None:
    """Run the contract (MACARON_CONTRACT_PATH, default contract 5) on a release (its adapters
    and its harness, greedy decoding, float32 whatever MACARON_DTYPE says) and print each
    suite's score and share of well-formed answers. The outcomes are recorded: a release is
    scored once per contract version, and the learning loop reuses them when the release is a
    run's parent."""
    from engines.local.engine import LocalEngine
    from learners.evaluation.evaluate import release_outcomes  # the engine and the trainer: torch

    cfg = settings(ctx)
    contract = load_split(cfg.contract_path or DEFAULT_CONTRACT, split)
    store = ArtifactStore(cfg.home / "adapters")
    with wiring.pool(cfg) as pool:
        with pool.connection() as conn:
            release = (
                active_release(conn) if release_id == "active" else release_by_id(conn, release_id)
            )
            harness = harness_by_name(conn, release.harness_version)
        engine = LocalEngine(wiring.model_dir(cfg))
        try:
            with console.status(f"running {contract.version} on {release.release_id}..."):
                load_release(engine, store, release)
                outcomes = release_outcomes(pool, engine, release, harness, contract)
        finally:
            engine.close()
    calls = outcomes.call_rates(contract)
    caption = (
        "well-formed: answers in the form their task asks for (GenUI tree, tool call, text and "
        "no call)"
    )
    table = Table(
        title=f"{contract.version} ({split} split) on {release.release_id} "
        f"({release.harness_version})",
        caption="\n".join(
            [caption, *(f"{CALL_RATES[name]}: {rate:.1%}" for name, rate in calls.items())]
        ),
    )
    for column in ("suite", "tasks", "well-formed", "passed", "score"):
        table.add_column(column, justify="left" if column == "suite" else "right")
    formats = outcomes.format_scores()
    for suite, done in outcomes.complete().items():
        formed = f"{formats[suite]:.1%}" if suite in formats else "-"
        table.add_row(suite, str(len(done)), formed, str(sum(done)), f"{sum(done) / len(done):.1%}")
    console.print(table)
