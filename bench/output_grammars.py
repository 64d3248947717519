"""Format and content apart: the contract's GenUI and agent suites on the root adapters, served
with ``harness@0`` and with a harness-only successor that enforces their output grammars.

Root adapters are version 0 (``B = 0``: they compute exactly SmolLM2-135M-Instruct); the
contract runs as the loop runs it (greedy, the contract's answer budgets, `CONCURRENCY` in flight
on the local engine). Per suite: the share of answers that are well-formed (a GenUI tree that
validates; a tool call that parses, on the tasks that expect a call) and the share that pass
their checker. Configurations: harness@0; the grammars enforced (an agent may still answer in
text); and, for the agent, a tool call required as the first step. Targets: 100 % well-formed
where the configuration guarantees the form; pass rates are reported.

Usage: python -m bench.output_grammars [--model PATH] [--suites genui,agent]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import zlib
from pathlib import Path

from bench.report import Row, report, row
from core.contract import Contract
from core.harness.artifact import HarnessSpec, HarnessVersion, root_harness
from core.settings import default_home
from engines.local.engine import LocalEngine
from infra.identity_adapter import write_identity_adapter
from infra.models import pull_model
from learners.evaluation.contract_runner import (
    CONTRACT_V1,
    ContractRun,
    load_contract,
    run_contract,
)

BASE_MODEL = "smollm2-135m-instruct"


def enforced(spec: HarnessSpec, specialists: list[str], *, required: bool = False) -> HarnessSpec:
    """``spec`` with the output grammar of ``specialists`` enforced at decode time (and, with
    ``required``, a tool call as the first step of those that call tools)."""
    changed = {}
    for name, own in spec.specialists.items():
        if name in specialists:
            update: dict[str, object] = {"enforce_grammar": True}
            if required and "tool_call" in own.output:
                update["tool_choice"] = "required"
            changed[name] = own.model_copy(update=update)
    return spec.model_copy(update={"specialists": {**spec.specialists, **changed}})


def measure(
    model_dir: Path, contract: Contract, harness: HarnessVersion
) -> tuple[ContractRun, float]:
    """The contract on fresh root adapters under ``harness``, and the seconds it took."""
    engine = LocalEngine(model_dir)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            adapters = {}
            for name in contract.specialists():
                folder = Path(scratch, name)
                write_identity_adapter(
                    model_dir,
                    folder,
                    base_model=BASE_MODEL,
                    rank=16,
                    seed=zlib.crc32(name.encode()),
                )
                engine.load_adapter(f"{name}@0", str(folder))
                adapters[name] = f"{name}@0"
            started = time.monotonic()
            run = asyncio.run(run_contract(engine, adapters, contract, harness=harness))
            return run, time.monotonic() - started
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--suites", default="genui,agent")
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    suites = args.suites.split(",")
    full = load_contract(CONTRACT_V1)
    root = root_harness()
    configurations = [
        ("harness@0", root, suites),
        ("grammar enforced", enforced(root, suites), suites),
        # only specialists that call tools answer differently when a call is required
        (
            "grammar enforced, tool call required",
            enforced(root, suites, required=True),
            [s for s in suites if "tool_call" in root.for_specialist(s).output],
        ),
    ]
    measured: dict[str, tuple[ContractRun, float]] = {}
    for number, (label, spec, measured_suites) in enumerate(configurations):
        if not measured_suites:
            continue
        contract = full.model_copy(update={"suites": {s: full.suites[s] for s in measured_suites}})
        version = HarnessVersion(
            version=number,
            sha256=spec.address,
            parent_version=None if number == 0 else 0,
            spec=spec,
        )
        measured[label] = measure(model_dir, contract, version)
    report("output_grammars", _rows(suites, measured))


def _rows(suites: list[str], measured: dict[str, tuple[ContractRun, float]]) -> list[Row]:
    """Per suite and configuration: well-formed (target 100 % once enforced) and passed, each
    against harness@0 as the baseline; then the contract's time per configuration."""
    base, base_seconds = measured["harness@0"]
    rows: list[Row] = []
    for suite in suites:
        formed_before = 100 * base.format_scores().get(suite, 0.0)
        passed_before = 100 * base.scores()[suite]
        for label, (run, _) in measured.items():
            if suite not in run.passed:
                continue
            # the form is guaranteed once enforced, except for an agent that may answer in text
            calls = "tool_call" in root_harness().for_specialist(suite).output
            guaranteed = label != "harness@0" and (not calls or "required" in label)
            target = ">= 100 %" if guaranteed else "report"
            formed = 100 * run.format_scores().get(suite, 0.0)
            passed = 100 * run.scores()[suite]
            rows.append(row(f"{suite}: well-formed, {label}", formed, "%", formed_before, target))
            rows.append(row(f"{suite}: passed, {label}", passed, "%", passed_before, "report"))
    for label, (run, seconds) in measured.items():
        tasks = sum(len(done) for done in run.passed.values())
        rows.append(
            row(f"contract time, {label} ({tasks} tasks)", seconds, "s", base_seconds, "report")
        )
    return rows


if __name__ == "__main__":
    main()
