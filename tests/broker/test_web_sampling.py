"""The chat page's sampling from its address: ``?temperature=0&maxTokens=64`` fills the
Options and every request asks for them (scripts/tools-demo.sh --web prints such an address:
the demo model answers in English greedy, docs/benchmarks/demo-model.md); without them the
page asks for the model's own temperature. In headless Chromium, on a real mosquitto; a
pretend worker (a retained ``online`` status) lets the page send, and the requests are read
off the broker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from devtools.browser import console_errors, open_page, wait
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.mqtt_client import pretend_worker as pretend_worker_on
from devtools.waiting import PATIENCE

PREFIX = "sampling"


@pytest.fixture
def requests(broker: Mosquitto) -> Iterator[Client]:
    with pretend_worker_on(broker.port, PREFIX) as watch:
        yield watch


def sent(page: str, browser: Any, broker: Mosquitto, requests: Client, session: str, **params: str) -> dict[str, Any]:
    """What the page sends for one message, opened with these URL parameters."""
    assert broker.ws_port is not None
    open_page(browser, page, broker.ws_port, "webuser", session, prefix=PREFIX, **params)
    browser.find_element("id", "connect").click()
    wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "subscribed", 30)
    browser.find_element("id", "message").send_keys("What is the capital of Italy?\n")
    message = requests.wait_for(lambda m: m.topic == f"{PREFIX}/webuser/{session}/request", timeout=PATIENCE)
    assert console_errors(browser) == []
    request: dict[str, Any] = json.loads(message.payload)
    return request


def test_the_address_sets_the_sampling_of_every_request(
    page_server: str, browser: Any, broker: Mosquitto, requests: Client
) -> None:
    asked = sent(page_server, browser, broker, requests, "s-url", temperature="0", maxTokens="64")
    assert (asked["temperature"], asked["maxTokens"]) == (0, 64)
    assert browser.find_element("id", "temperature").get_attribute("value") == "0"
    # Without them: the model's temperature (none sent), the field's 256 tokens.
    plain = sent(page_server, browser, broker, requests, "s-plain")
    assert "temperature" not in plain and plain["maxTokens"] == 256
