"""The operator console in headless Chromium against a real server with real events: the
release timeline and lineage, promote and roll back with confirmation, live scores with their
charts, one turn's audit, and a chat key refused. Screenshots of each view are saved."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from engines.instant import InstantEngine
from infra.identity_adapter import write_identity_adapter
from infra.local_stack import LocalStack
from infra.postgres.runs import record_release_score
from server.router import RouterService
from tests.serving import Running, following, frames_until, send, serving, successor

SCREENSHOTS = Path("build/screenshots")


@pytest.fixture(scope="module")
def served(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    engine = InstantEngine(lambda messages: "A short answer.")
    with serving(
        stack, tmp_path_factory, router=router, model_dir=tiny_model, engine=engine
    ) as running:
        yield running


def traffic(served: Running) -> list[str]:
    """Turns of two specialists, one thumbed up and one corrected; their turn ids."""
    turn_ids = []
    with served.connect(served.key("console-user")) as ws:
        frames_until(ws, "ready")
        for n, (hint, feedback) in enumerate([("chat", "up"), ("coding", "edit"), ("chat", None)]):
            send(ws, type="user_turn", client_msg_id=f"c{n}", content="hi", specialist_hint=hint)
            turn_id = frames_until(ws, "turn_completed")[0]["turn_id"]
            if feedback is not None:
                extra = {"edited_text": "Better."} if feedback == "edit" else {}
                send(ws, type="feedback", turn_id=turn_id, kind=feedback, **extra)
            turn_ids.append(turn_id)
        send(ws, type="ping")
        frames_until(ws, "pong")
    return turn_ids


def test_the_console_shows_releases_scores_and_an_audit_and_promotes(
    served: Running, page: Page, tiny_model: Path, tmp_path: Path
) -> None:
    root = served.server.chat.release.release_id
    write_identity_adapter(
        tiny_model, tmp_path / "coding", base_model=tiny_model.name, rank=4, seed=1
    )
    child = successor(served, tmp_path / "coding", 4, "coding")
    with served.server.pool.connection() as conn:  # as `macaron contract run` records one
        record_release_score(
            conn,
            evaluation_id=uuid.uuid4(),
            release_id=root,
            contract_version="contract-test",
            scores={
                "release": {"chat": 0.25, "genui": 0.5},
                "formats": {"release": {"genui": 1.0}},
            },
        )
    with following(served):
        turn_ids = traffic(served)
        page.on("dialog", lambda dialog: dialog.accept())  # the confirmations
        page.goto(f"{served.http}/console")
        page.get_by_test_id("admin-key").fill(served.key("operator", "admin"))
        page.get_by_test_id("load").click()
        rows = page.get_by_test_id("release-row")
        expect(rows).to_have_count(2)
        expect(page.get_by_test_id("exposure")).to_be_hidden()  # no tenant forgotten
        expect(rows.filter(has=page.get_by_test_id("active"))).to_contain_text(root)
        expect(page.get_by_test_id("lineage-step")).to_have_count(1)

        rows.filter(has_text=child.release_id).get_by_test_id("promote").click()
        expect(page.get_by_test_id("notice")).to_contain_text(f"promote of {child.release_id}")
        expect(rows.filter(has=page.get_by_test_id("active"))).to_contain_text(child.release_id)
        expect(page.get_by_test_id("lineage-step")).to_have_count(2)  # child <- root
        expect(page.get_by_test_id("lineage")).to_contain_text("coding@1")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "console-releases.png"), full_page=True)

        page.get_by_test_id("tab-scores").click()
        scored = page.get_by_test_id("score-row")
        expect(scored.filter(has_text="coding")).to_contain_text("100 %")  # its one edit
        expect(page.get_by_test_id("score-chart").get_by_test_id("bar-chart")).to_have_count(2)
        expect(page.get_by_test_id("contract-chart").get_by_test_id("bar-chart")).to_have_count(2)
        expect(page.get_by_test_id("contract-row")).to_contain_text("chat 0.25 · genui 0.50 / 1.00")
        page.screenshot(path=str(SCREENSHOTS / "console-scores.png"), full_page=True)

        page.get_by_test_id("tab-audit").click()
        page.get_by_test_id("turn-id").fill(turn_ids[0])
        page.get_by_test_id("audit-turn").click()
        expect(page.get_by_test_id("chain")).to_contain_text("verified")
        expect(page.get_by_test_id("served-by")).to_contain_text(f"{root} · chat@0")
        expect(page.get_by_test_id("taught-by")).to_contain_text("a root adapter")
        expect(page.get_by_test_id("audit-events")).to_contain_text("FeedbackGiven")
        page.get_by_test_id("verify").click()
        expect(page.get_by_test_id("verified")).to_contain_text(
            "0 chain violations, 0 adapter failures"
        )
        expect(page.get_by_test_id("verified")).to_contain_text("record verified")
        page.screenshot(path=str(SCREENSHOTS / "console-audit.png"), full_page=True)

    page.get_by_test_id("tab-releases").click()
    page.get_by_test_id("rollback").click()
    expect(page.get_by_test_id("notice")).to_contain_text(f"rollback of {root}: done")
    assert served.server.chat.release.release_id == root

    page.get_by_test_id("admin-key").fill(served.key("console-user"))  # a chat key
    page.get_by_test_id("load").click()
    expect(page.get_by_test_id("notice")).to_contain_text("forbidden")
