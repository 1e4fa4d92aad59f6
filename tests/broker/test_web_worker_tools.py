"""The chat page (worker/web) with the worker's own tools (docs/tools.md), in headless Chromium:
the page's "Use the worker's tools" sends workerTools, shows each worker call as it runs (the
stream's toolEvent deltas), lists the reply's workerCalls, and asks the user to approve a call
with needsConfirmation. Real parts but the engine: the in-process worker (devtools/inproc.py)
with its real device tools on a real mosquitto, answered by the simulated devices
(devtools/devices.py); the fake engine writes the model's calls, which vLLM's hermes parser reads."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from devtools.browser import console_errors, open_page, wait
from devtools.devices import SimulatedDevices
from devtools.fakes import FakeEngine
from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from worker.engine.tokenizer import ChatTokenizer
from worker.engine.vllm import tool_support

DEVICE_DELAY_MS = 400  # each device answers this late: the page shows the call running meanwhile
LAMP = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
TOOLS = {
    "mqtt": [
        {"name": "sensor_read", "topic": "devices/sensor/read", "users": ["*"]},
        {"name": "lamp_set", "topic": "devices/lamp/set", "parameters": LAMP, "users": ["*"]},
        # The same lamp, switched only once the user approves.
        {"name": "lamp_set_confirmed", "topic": "devices/lamp/set", "parameters": LAMP, "users": ["*"]}
        | {"confirm": True},
    ]
}

# Every text a worker-call line of the page showed, in order ([requestId, text]).
RECORD_TOOL_LINES = """
window.__toolLines = [];
new MutationObserver((records) => {
  for (const r of records) {
    for (const node of r.addedNodes) {
      if (node.nodeType !== 1 || !node.matches('.tool-event, .worker-call')) continue;
      window.__toolLines.push([node.closest('article').dataset.requestId, node.textContent]);
    }
  }
}).observe(document.getElementById('transcript'), {subtree: true, childList: true});
"""


def call(name: str, arguments: dict[str, Any] | None = None) -> str:
    """A call as the model writes it (Hermes style)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments or {})}}}\n</tool_call>'


@pytest.fixture
def devices(broker: Mosquitto) -> Iterator[SimulatedDevices]:
    sim = SimulatedDevices(port=broker.port, delay_ms=DEVICE_DELAY_MS)
    sim.start()
    yield sim
    sim.stop()


@pytest.fixture
def live(broker: Mosquitto, tokenizer: ChatTokenizer, devices: SimulatedDevices) -> Iterator[LiveWorker]:
    worker = LiveWorker(
        broker.port, engine=FakeEngine(), tool_support=tool_support("auto", tokenizer, "tiny"), tools=TOOLS
    )
    yield worker
    worker.close()


def turns(driver: Any) -> list[dict[str, Any]]:
    """Each turn as the user sees it."""
    result: list[dict[str, Any]] = driver.execute_script(
        """return [...document.querySelectorAll('#transcript article.turn')].map(a => ({
             requestId: a.dataset.requestId, status: a.dataset.status, kind: a.dataset.kind,
             reply: a.querySelector('.reply-text').textContent,
             workerCalls: [...a.querySelectorAll('.worker-call')].map(c => [c.dataset.toolCallId, c.textContent]),
             events: [...a.querySelectorAll('.tool-event')].map(c => c.textContent),
             calls: [...a.querySelectorAll('.tool-call')].map(c => [c.dataset.toolCallId, c.textContent]),
             buttons: [...a.querySelectorAll('.confirm button')].map(b => [b.textContent, b.disabled]),
             results: [...a.querySelectorAll('.tool-result')].map(r => [r.dataset.toolCallId, r.textContent])}))"""
    )
    return result


def send(driver: Any, message: str) -> str:
    before = len(turns(driver))
    driver.find_element("id", "message").send_keys(message + "\n")
    wait(driver, lambda d: len(turns(d)) == before + 1, "the new turn", 30)
    request_id: str = turns(driver)[-1]["requestId"]
    return request_id


def settled(driver: Any, count: int) -> list[dict[str, Any]]:
    """The turns once there are count of them and none is pending."""

    def done(d: Any) -> list[dict[str, Any]] | None:
        shown = turns(d)
        return shown if len(shown) == count and all(t["status"] != "pending" for t in shown) else None

    result: list[dict[str, Any]] = wait(driver, done, f"{count} settled turns", 30)
    return result


def test_the_page_shows_worker_calls_as_they_run_and_asks_before_a_confirmed_one(
    broker: Mosquitto, live: LiveWorker, devices: SimulatedDevices, browser: Any, page_server: str
) -> None:
    user, session = "webdev", "d-" + uuid.uuid4().hex[:10]
    requests = Client(broker.port, [live.topic(user, session), live.topic(user, session, "reply")])
    assert broker.ws_port is not None
    open_page(browser, page_server, broker.ws_port, user, session, prefix=live.prefix)
    browser.find_element("id", "connect").click()
    wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "subscribed", 30)
    browser.execute_script(RECORD_TOOL_LINES)
    browser.find_element("css selector", "#options summary").click()
    assert not browser.find_element("id", "tool-choice").is_enabled()  # no tool: no choice
    browser.find_element("id", "use-worker-tools").click()
    assert browser.find_element("id", "tool-choice").is_enabled()

    # A loop of two device rounds: the sensor, then the lamp; then the answer.
    devices.lamp_on = True
    live.engine.rounds[""] = [call("sensor_read"), call("lamp_set", {"on": False}), "The room is empty: lamp off."]
    request_id = send(browser, "Lamp off if the room is empty")
    (turn,) = settled(browser, 1)
    sent = requests.wait_for(lambda m: m.topic.endswith("/request") and m.json()["requestId"] == request_id).json()
    assert sent["workerTools"] == ["*"] and sent["tools"] == []
    reply = requests.wait_for(lambda m: m.topic.endswith("/reply") and m.json()["requestId"] == request_id).json()
    assert turn["reply"] == reply["reply"] == "The room is empty: lamp off."
    sensor, lamp = reply["workerCalls"]
    assert [call_id for call_id, _ in turn["workerCalls"]] == [sensor["id"], lamp["id"]]
    assert re.fullmatch(
        rf"worker call ✓ sensor_read \{{\}} → {re.escape(sensor['result'])} \(ok, [\d.]+ m?s, round 1\)",
        turn["workerCalls"][0][1],
    )
    assert re.fullmatch(
        r'worker call ✓ lamp_set \{"on": false\} → \{"on": false\} \(ok, [\d.]+ m?s, round 2\)',
        turn["workerCalls"][1][1],
    )
    assert sensor["durationMs"] >= DEVICE_DELAY_MS and lamp["durationMs"] >= DEVICE_DELAY_MS
    assert json.loads(sensor["result"]) == {"temperature_c": 21.5, "occupied": False}
    assert not devices.lamp_on and [c["topic"] for c in devices.calls] == ["devices/sensor/read", "devices/lamp/set"]
    # While the reply streamed, each call was shown running, then how it ended, in that order;
    # the reply's list came last.
    lines = [text for rid, text in browser.execute_script("return window.__toolLines") if rid == request_id]
    shown = list(dict.fromkeys(lines))  # a line is drawn again on every frame of the turn
    running = shown.index("▶ sensor_read running…")
    assert shown[running + 1].startswith("✓ sensor_read ") and shown[running + 1].endswith(" ms (ok)")
    assert shown[running + 2] == "▶ lamp_set running…"
    # The last call's end and the reply may come within one frame (the page draws at most once
    # a frame, and the fake engine answers at once): then the reply's list is what shows it.
    between = shown[running + 3 : -2]
    assert between == [] or (len(between) == 1 and between[0].startswith("✓ lamp_set ")), shown
    assert shown[-2:] == [text for _, text in turn["workerCalls"]]

    # A call that needs confirmation: Approve runs it.
    live.engine.rounds[""] = [call("lamp_set_confirmed", {"on": True}), "The lamp is on."]
    request_id = send(browser, "Lamp on, please")
    (asked,) = settled(browser, 2)[1:]
    ((call_id, text),) = asked["calls"]
    assert text.startswith("the worker asks to run lamp_set_confirmed") and asked["buttons"] == [
        ["Approve", False],
        ["Decline", False],
    ]
    assert len(devices.calls) == 2  # not run before the user says so
    browser.find_element("css selector", f'.tool-call[data-tool-call-id="{call_id}"] button.approve').click()
    answered = settled(browser, 3)[2]
    sent = requests.wait_for(lambda m: m.topic.endswith("/request") and m.json()["requestId"] == answered["requestId"])
    assert sent.json()["toolResults"] == [{"toolCallId": call_id, "approved": True}]
    assert answered["results"] == [[call_id, "approved lamp_set_confirmed"]]
    assert answered["reply"] == "The lamp is on." and devices.lamp_on
    assert [c[0] for c in answered["workerCalls"]] == [call_id]
    assert turns(browser)[1]["buttons"] == []  # decided: no buttons any more
    if os.environ.get("TOOLS_PAGE_SCREENSHOT"):  # to look at it
        browser.save_screenshot(os.environ["TOOLS_PAGE_SCREENSHOT"])

    # Decline: the device never hears of it; the choice survives a reload.
    live.engine.rounds[""] = [call("lamp_set_confirmed", {"on": False}), "Left as it is."]
    send(browser, "Lamp off again")
    asked = settled(browser, 4)[3]
    ((call_id, _),) = asked["calls"]
    browser.refresh()
    wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "reconnected after the reload", 30)
    assert turns(browser)[3]["buttons"] == [["Approve", False], ["Decline", False]]
    browser.find_element("css selector", f'.tool-call[data-tool-call-id="{call_id}"] button.decline').click()
    answered = settled(browser, 5)[4]
    sent = requests.wait_for(lambda m: m.topic.endswith("/request") and m.json()["requestId"] == answered["requestId"])
    assert sent.json()["toolResults"] == [{"toolCallId": call_id, "approved": False}]
    assert answered["results"] == [[call_id, "declined lamp_set_confirmed"]] and answered["reply"] == "Left as it is."
    assert len(devices.calls) == 3 and devices.lamp_on

    # Unticked (the choice was kept over the reload): workerTools [] clears the session's.
    browser.find_element("css selector", "#options summary").click()
    box = browser.find_element("id", "use-worker-tools")
    assert box.is_selected()
    box.click()
    live.engine.rounds[""] = ["No tools now."]
    request_id = send(browser, "Hello")
    settled(browser, 6)
    sent = requests.wait_for(lambda m: m.topic.endswith("/request") and m.json()["requestId"] == request_id).json()
    assert sent["workerTools"] == []
    assert console_errors(browser) == []
    requests.close()
