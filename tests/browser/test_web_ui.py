"""The web UI in headless Chromium (Debian's, driven by Playwright): connect, chat with
streaming, render a GenUI tree and press its button, give feedback; a screenshot is saved."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, WebSocket, expect

from core.events import FeedbackGiven, RoutingCorrected, TurnReceived
from engines.instant import InstantEngine
from infra.local_stack import LocalStack
from server.router import RouterService
from tests.serving import Running, serving

SCREENSHOT = Path("build/screenshots/web_ui.png")
CARD = {
    "type": "Card",
    "title": "Your trip",
    "children": [
        {"type": "Heading", "text": "Lisbon", "level": 3},
        {"type": "Table", "columns": ["day", "plan"], "rows": [["1", "Alfama"], ["2", "Belém"]]},
        {
            "type": "Chart",
            "kind": "bar",
            "labels": ["Mon", "Tue"],
            "series": [{"name": "°C", "values": [21, 24]}],
        },
        {"type": "Button", "id": "book", "label": "Book it", "action": "book"},
    ],
}


def script(messages: list[dict[str, str]]) -> str:
    content = messages[-1]["content"]
    if content == "plan a trip":
        return json.dumps(CARD)
    if content.startswith("ui_event "):
        return json.dumps({"type": "Text", "text": "Booked."})
    return "Hello! I am a streaming answer of several words."


@pytest.fixture(scope="module")
def served(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    with serving(
        stack, tmp_path_factory, router=router, model_dir=tiny_model, engine=InstantEngine(script)
    ) as running:
        yield running


def test_chat_genui_and_feedback_in_the_browser(served: Running, page: Page) -> None:
    received: list[dict[str, Any]] = []

    def watch(socket: WebSocket) -> None:
        socket.on("framereceived", lambda payload: received.append(json.loads(payload)))

    page.on("websocket", watch)
    page.goto(served.http)
    page.get_by_test_id("api-key").fill(served.key("browser-tenant"))
    page.get_by_test_id("connect").click()
    expect(page.get_by_test_id("status")).to_have_attribute("data-state", "connected")

    page.get_by_test_id("input").fill("hello")
    page.get_by_test_id("send").click()
    answer = page.get_by_test_id("assistant").first
    expect(answer).to_contain_text("Hello! I am a streaming answer of several words.")
    expect(answer.get_by_test_id("badge")).to_contain_text("@0")
    assert len([f for f in received if f["type"] == "token"]) > 1  # it streamed

    page.get_by_test_id("specialist").select_option("genui")
    page.get_by_test_id("input").fill("plan a trip")
    page.get_by_test_id("send").click()
    card = page.locator(".genui-card")
    expect(card).to_contain_text("Lisbon")
    expect(page.locator(".genui-table")).to_contain_text("Belém")
    expect(page.locator(".genui-chart svg")).to_be_visible()
    expect(answer.get_by_test_id("up")).to_be_visible()
    answer.get_by_test_id("up").click()
    expect(answer.get_by_test_id("up")).to_have_class("fb pressed")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    page.locator('[data-component-id="book"]').click()
    expect(page.get_by_test_id("assistant").nth(2)).to_contain_text("Booked.")

    answer.get_by_test_id("reroute").select_option("coding")  # another specialist, please
    rerouted = page.get_by_test_id("assistant").nth(3)
    expect(rerouted.get_by_test_id("badge")).to_contain_text("coding")
    expect(rerouted).to_contain_text("Hello! I am a streaming answer")

    events = served.events()
    kinds = [e.payload.kind for e in events if isinstance(e.payload, FeedbackGiven)]
    assert kinds == ["up"]
    inputs = [e.payload.input_kind for e in events if isinstance(e.payload, TurnReceived)]
    assert inputs == ["text", "text", "ui_event", "text"]
    [corrected] = [e.payload for e in events if isinstance(e.payload, RoutingCorrected)]
    assert corrected.specialist == "coding"
    assert SCREENSHOT.stat().st_size > 10_000
