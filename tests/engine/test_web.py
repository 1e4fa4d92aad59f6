"""The browser chat page (worker/web) in a real browser: Debian's headless Chromium driven by
Selenium, the page served by ``worker.web``, MQTT over WebSockets to the session's mosquitto
(its ``lo`` WebSockets listener), answered by the session's shared worker (real vLLM CPU engine,
tiny random model: its text is noise, its streaming, token counts and history are real)."""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import re
import shutil
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools import REPO
from devtools.acl import PASSWORDS, documented_acl_broker, logged_in_worker
from devtools.browser import chromium, console_errors, open_page, served_page, wait
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.waiting import PATIENCE
from devtools.worker_process import WorkerProcess
from worker.protocol.messages import log_ref
from worker.web import STATIC_DIR

BROWSER_TZ = "Asia/Kathmandu"  # UTC+05:45 all year


@pytest.fixture(scope="module")
def page_server() -> Iterator[str]:
    with served_page() as url:
        yield url


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=PATIENCE) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_server_serves_the_page_and_nothing_else(page_server: str) -> None:
    status, headers, body = get(page_server + "/")
    assert status == 200 and b'<script src="vendor/mqtt.min.js"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert get(page_server + "/chat.js")[0] == 200
    assert get(page_server + "/vendor/")[0] == 404  # no listings
    assert get(page_server + "/../__init__.py")[0] == 404
    assert get(page_server + "/%2e%2e/__init__.py")[0] == 404


def test_the_vendored_mqtt_js_is_the_one_the_recipe_pins() -> None:
    recipe = (REPO / "scripts" / "vendor-mqtt.sh").read_text()
    match = re.search(r"^BUNDLE_SHA256=([0-9a-f]{64})$", recipe, re.M)
    assert match
    bundle = (STATIC_DIR / "vendor" / "mqtt.min.js").read_bytes()
    assert hashlib.sha256(bundle).hexdigest() == match[1]
    assert (STATIC_DIR / "vendor" / "mqtt.LICENSE.md").read_text().startswith("The MIT License")


# ---- the browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # A time zone far from the machine's (UTC on CI): the page's local-time tool must report
    # the browser's own.
    with chromium(tmp_path_factory.mktemp("chromium"), BROWSER_TZ) as driver:
        yield driver


def turns(driver: Any) -> list[dict[str, Any]]:
    """Each turn on the page as the user sees it (text content, not the page's own state)."""
    result: list[dict[str, Any]] = driver.execute_script(
        """return [...document.querySelectorAll('#transcript article.turn')].map(a => ({
             requestId: a.dataset.requestId, status: a.dataset.status,
             finishReason: a.dataset.finishReason, errorCode: a.dataset.errorCode,
             user: a.querySelector('.user').textContent,
             reply: a.querySelector('.reply-text').textContent,
             meta: a.querySelector('.meta').textContent,
             reasoning: a.querySelector('.reasoning').hidden ? null : a.querySelector('.reasoning-text').textContent,
             reasoningOpen: a.querySelector('.reasoning').open, kind: a.dataset.kind,
             calls: [...a.querySelectorAll('.tool-call')].map(c => [c.dataset.toolCallId, c.textContent]),
             results: [...a.querySelectorAll('.tool-result')].map(r => [r.dataset.toolCallId, r.textContent])}))"""
    )
    return result


def last_turn(driver: Any) -> dict[str, Any]:
    return turns(driver)[-1]


def set_field(driver: Any, element_id: str, value: str) -> None:
    element = driver.find_element("id", element_id)
    if not element.is_displayed():  # in the folded options
        driver.find_element("css selector", "#options summary").click()
    element.clear()
    element.send_keys(value)


def send(driver: Any, message: str, max_tokens: int) -> str:
    """Type the message and press Enter; the new turn's requestId."""
    set_field(driver, "max-tokens", str(max_tokens))
    before = len(turns(driver))
    box = driver.find_element("id", "message")
    box.send_keys(message)
    box.send_keys("\n")
    wait(driver, lambda d: len(turns(d)) == before + 1, "the new turn")
    request_id: str = last_turn(driver)["requestId"]
    return request_id


def finished(driver: Any, request_id: str, timeout: float = PATIENCE) -> dict[str, Any]:
    def done(d: Any) -> dict[str, Any] | None:
        turn = next((t for t in turns(d) if t["requestId"] == request_id), None)
        return turn if turn and turn["status"] != "pending" else None

    result: dict[str, Any] = wait(driver, done, f"the reply to {request_id}", timeout)
    return result


def worker_reply(client: Client, user: str, session: str, request_id: str) -> dict[str, Any]:
    reply: dict[str, Any] = client.wait_for(
        lambda m: m.topic == f"chat/{user}/{session}/reply" and m.json().get("requestId") == request_id
    ).json()
    return reply


# Every text a reply showed before its last, one record per change (several deltas handled in
# one task are several records): the text each change replaced, which no later change alters
# (Chromium sets the data of a lone text node: characterData records with their old value;
# otherwise the old text node is removed: childList records).
def shown_lengths(driver: Any, request_id: str) -> list[int]:
    """The lengths of the texts this reply showed before its current one (RECORD_STREAM)."""
    return [n for rid, n in driver.execute_script("return window.__seen") if rid == request_id]


def stream_of(client: Client, user: str, session: str, request_id: str) -> list[dict[str, Any]]:
    """The worker's deltas of this request, in order (seen before its reply, which came last)."""
    topic = f"chat/{user}/{session}/stream"
    deltas = [m.json() for m in client.seen if m.topic == topic and m.json()["requestId"] == request_id]
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    return deltas


RECORD_STREAM = """
window.__seen = [];
new MutationObserver((records) => {
  for (const r of records) {
    const el = r.type === 'characterData' ? r.target.parentElement : r.target;
    if (!el || !el.classList.contains('reply-text')) continue;
    const id = el.closest('article').dataset.requestId;
    if (r.type === 'characterData') window.__seen.push([id, r.oldValue.length]);
    else for (const node of r.removedNodes) window.__seen.push([id, node.textContent.length]);
  }
}).observe(document.getElementById('transcript'),
           {subtree: true, childList: true, characterData: true, characterDataOldValue: true});
"""


@pytest.mark.e2e
def test_the_page_chats_streams_cancels_and_resumes_after_a_reload(
    shared_worker: WorkerProcess, broker: Mosquitto, client: Client, browser: Any, page_server: str, tmp_path: Path
) -> None:
    user, session = "webuser", "w-" + uuid.uuid4().hex[:12]
    assert broker.ws_port is not None
    open_page(browser, page_server, broker.ws_port, user, session)
    browser.find_element("id", "connect").click()
    wait(browser, lambda d: "shared online" in d.find_element("id", "worker-status").text, "the worker's status")
    wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "subscribed")
    browser.execute_script(RECORD_STREAM)

    # Three turns: the text grows while it streams, the final reply is the worker's, and each
    # turn's prompt holds the history before it.
    prompt_tokens: list[int] = []
    grew = 0
    for message in ("Hello there!", "Tell me more.", "And then?"):
        request_id = send(browser, message, 64)
        shown = finished(browser, request_id)
        reply = worker_reply(client, user, session, request_id)
        assert shown["status"] == "done" and shown["finishReason"] == reply["finishReason"] == "length"
        assert shown["user"] == message and shown["reply"] == reply["reply"]
        usage = reply["usage"]
        assert f"{usage['promptTokens']} prompt tokens ({usage['cachedTokens']} cached)" in shown["meta"]
        assert f"{usage['completionTokens']} completion" in shown["meta"]
        # While it streamed, the page showed the worker's deltas put together so far, and only
        # that. (The page draws once a frame, so deltas of one frame show together.)
        partials = list(itertools.accumulate(len(d["delta"]) for d in stream_of(client, user, session, request_id)))
        shown_before = set(shown_lengths(browser, request_id)) - {0, len(reply["reply"])}
        assert partials and shown_before <= set(partials), (shown_before, partials)
        grew += len(shown_before)
        prompt_tokens.append(usage["promptTokens"])
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2]
    assert grew, "no reply was seen growing"

    # Cancel. A request of the test's own client, sent first, holds the session, so the page's
    # request waits behind it and the page's Cancel reaches the worker while that request is
    # in flight. The engine is frozen meanwhile, so the hold lasts as long as the browser
    # needs: headless Chromium on 2 busy cores at times took longer to type and click than a
    # tiny-model reply of 1000 tokens takes (about 2.5 s), and the page's request then ran to
    # its end before its cancel. The publish waits for the broker's PUBACK: the worker gets the
    # busy request before the page's. (Cancelling a running generation is tested in
    # test_e2e.py and test_chat.py.)
    busy = "busy"
    with shared_worker.engine_frozen():
        client.publish(f"chat/{user}/{session}/request", {"message": "Busy.", "maxTokens": 1000, "requestId": busy})
        request_id = send(browser, "Now a very long story, please.", 1000)

        def cancel_taken(driver: Any) -> bool:
            """Clicked until the page shows the turn cancelling: a loaded headless Chromium can
            lose a click (the request is held behind the busy one meanwhile)."""
            if last_turn(driver)["meta"] == "cancelling…":
                return True
            button = driver.find_element("id", "cancel")
            if button.is_enabled():
                button.click()
            return False

        wait(browser, cancel_taken, "the page to take the cancel", timeout=PATIENCE)
        # The worker has the page's cancel (its log names the request by log_ref) while the
        # request still waits for its turn.
        ref = log_ref(request_id)
        shared_worker.wait_log(rf"Cancel(?:ling (?:running|queued) request| for) {ref}")
        assert f"Cancel for {ref}" not in shared_worker.log(), "the page's cancel came before its request"
    client.publish(f"chat/{user}/{session}/control", {"action": "cancel", "requestId": busy})  # not needed any more
    shown = finished(browser, request_id)
    reply = worker_reply(client, user, session, request_id)
    assert shown["finishReason"] == reply["finishReason"] == "cancelled", shown["meta"]
    assert reply["usage"]["completionTokens"] < 1000 and shown["reply"] == reply["reply"]
    assert not browser.find_element("id", "cancel").is_enabled()
    worker_reply(client, user, session, busy)

    # An error shows its code.
    request_id = send(browser, "Too many tokens.", 5000)
    shown = finished(browser, request_id)
    assert shown["status"] == "error" and shown["errorCode"] == "invalid_request"
    assert shown["meta"].startswith("invalid_request")

    # Reload while a reply is being generated: the page comes back with the transcript, sends
    # the pending request again with its requestId and shows the one reply.
    request_id = send(browser, "Reloading now.", 200)
    browser.refresh()
    wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "reconnected after the reload")
    shown = finished(browser, request_id)
    reply = worker_reply(client, user, session, request_id)
    assert shown["status"] == "done" and shown["reply"] == reply["reply"]
    after_reload = turns(browser)
    assert [t["user"] for t in after_reload] == [
        "Hello there!",
        "Tell me more.",
        "And then?",
        "Now a very long story, please.",
        "Too many tokens.",
        "Reloading now.",
    ]
    assert [t["requestId"] for t in after_reload].count(request_id) == 1
    # The worker's session goes on: the next prompt holds the history (cancelled and refused
    # turns are not in it).
    request_id = send(browser, "Still there?", 24)
    finished(browser, request_id)
    next_usage = worker_reply(client, user, session, request_id)["usage"]
    assert next_usage["promptTokens"] > reply["usage"]["promptTokens"] > prompt_tokens[2]
    assert "shared online" in browser.find_element("id", "worker-status").text

    screenshot = tmp_path / "chat-page.png"
    browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("CHAT_PAGE_SCREENSHOT"):  # to look at it
        shutil.copy(screenshot, os.environ["CHAT_PAGE_SCREENSHOT"])

    assert console_errors(browser) == []

    # Reset: the worker forgets the conversation, the page clears it.
    browser.find_element("id", "reset").click()
    wait(browser, lambda d: "forgot this conversation" in d.find_element("id", "transcript").text, "the reset")
    assert turns(browser) == []
    request_id = send(browser, "Hello there!", 24)
    finished(browser, request_id)
    assert worker_reply(client, user, session, request_id)["usage"]["promptTokens"] == prompt_tokens[0]


@pytest.fixture
def acl_ws_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    """mosquitto with passwords and docs/security.md's ACL, and a WebSockets listener."""
    broker = documented_acl_broker(tmp_path, websockets=True)
    yield broker
    broker.stop()


def test_the_page_logs_in_as_the_user_under_the_documented_acl(
    acl_ws_broker: Mosquitto, browser: Any, page_server: str
) -> None:
    """The user's own login over WebSockets, with docs/security.md's ACL: a wrong password is
    refused and said so; alice is answered and sees the worker online; a think block is folded.
    (The worker is in-process with a scripted fake engine: the broker's side is what is
    tested here, and the page's display of reasoning, which the tiny model cannot show.)"""
    live = logged_in_worker(acl_ws_broker.port)
    try:
        assert acl_ws_broker.ws_port is not None
        open_page(browser, page_server, acl_ws_broker.ws_port, "alice", "s-" + uuid.uuid4().hex[:8])
        set_field(browser, "password", "bob-secret")
        browser.find_element("id", "connect").click()
        problem = wait(browser, lambda d: d.find_element("id", "login-problem").text, "the refusal")
        assert "refused the login" in problem
        assert not browser.find_element("id", "send").is_enabled()

        set_field(browser, "password", PASSWORDS["alice"])
        browser.find_element("id", "connect").click()
        wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "subscribed")
        wait(browser, lambda d: "gpu-1 online" in d.find_element("id", "worker-status").text, "the worker's status")
        request_id = send(browser, "hello", 3)
        shown = finished(browser, request_id, timeout=PATIENCE)
        assert (shown["status"], shown["reply"], shown["finishReason"]) == ("done", "w0 w1 w2 ", "length")
        assert shown["reasoning"] is None
        assert not browser.find_element("id", "login-problem").is_displayed()

        # A reasoning model's think block: shown folded above the answer.
        browser.find_element("id", "new-session").click()
        wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "subscribed in the new session")
        session = browser.find_element("id", "session-id").get_property("value")
        live.engine.script[session] = ["<think>", "The user greets me.", "</think>", "\n\nHello, alice!"]
        request_id = send(browser, "hello again", 16)
        shown = finished(browser, request_id, timeout=PATIENCE)
        assert (shown["reply"], shown["reasoning"], shown["reasoningOpen"]) == (
            "Hello, alice!",
            "The user greets me.",
            False,
        )
        assert [t["requestId"] for t in turns(browser)] == [request_id]  # a new session starts empty
        # The refused login is the only error (MQTT.js reports it on the console).
        errors = console_errors(browser)
        assert all("Not authorized" in e["message"] or "Bad User Name" in e["message"] for e in errors), errors
    finally:
        live.close()


LOCAL_TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_local_time",
        "description": "Get the user's current local time, date and time zone.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.e2e
def test_the_page_runs_its_local_time_tool_when_the_model_calls_it(
    shared_worker: WorkerProcess, broker: Mosquitto, client: Client, browser: Any, page_server: str
) -> None:
    """The tool offered and forced (Options): the page shows the call, runs it in the browser,
    sends its result and shows the result and the answer. Unforced, the random model does not
    call it, and the page sends nothing more."""
    from selenium.webdriver.support.ui import Select

    user, session = "webtools", "t-" + uuid.uuid4().hex[:12]
    requests = Client(broker.port, [f"chat/{user}/{session}/request"])
    assert broker.ws_port is not None
    open_page(browser, page_server, broker.ws_port, user, session)
    browser.find_element("id", "connect").click()
    wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "subscribed")
    set_field(browser, "max-tokens", "64")  # room for a forced call (one cut short is no call)
    assert not browser.find_element("id", "tool-choice").is_enabled()  # no tool offered: no choice
    browser.find_element("id", "offer-time-tool").click()
    Select(browser.find_element("id", "tool-choice")).select_by_value("get_local_time")

    browser.find_element("id", "message").send_keys("What time is it?\n")
    wait(browser, lambda d: len(turns(d)) == 2 and turns(d)[1]["status"] != "pending", "the tool round", 180)
    asked, answered = turns(browser)
    first = worker_reply(client, user, session, asked["requestId"])
    (call,) = first["toolCalls"]
    assert call["function"] == {"name": "get_local_time", "arguments": "{}"}
    assert (asked["kind"], asked["finishReason"], first["finishReason"]) == ("message", "tool_calls", "tool_calls")
    assert asked["calls"] == [[call["id"], "tool call get_local_time {}"]]

    # The page's request with the result, and what the browser says its clock and zone are.
    sent = requests.wait_for(lambda m: m.json()["requestId"] == answered["requestId"]).json()
    (result,) = sent["toolResults"]
    assert result["toolCallId"] == call["id"] and "message" not in sent and "toolChoice" not in sent
    shown_time = re.fullmatch(
        # Chromium's ICU names it by its older spelling, Asia/Katmandu.
        r"The local time is (\d\d):(\d\d) on \w+,? .+ \(time zone Asia/Kath?mandu, UTC\+05:45\)\.",
        result["content"],
    )
    assert shown_time, result["content"]
    now = datetime.datetime.now(datetime.timezone(datetime.timedelta(hours=5, minutes=45)))
    assert (now.hour * 60 + now.minute - int(shown_time[1]) * 60 - int(shown_time[2])) % 1440 <= 3
    assert answered["kind"] == "results" and answered["results"] == [
        [call["id"], f"tool result get_local_time: {result['content']}"]
    ]
    final = worker_reply(client, user, session, answered["requestId"])
    assert "toolCalls" not in final and answered["finishReason"] == final["finishReason"] in ("stop", "length")
    assert answered["reply"] == final["reply"] and answered["calls"] == []
    assert final["usage"]["promptTokens"] > first["usage"]["promptTokens"]

    # Unforced: the tools are sent again (the same list), no toolChoice, no call, no results.
    Select(browser.find_element("id", "tool-choice")).select_by_value("auto")
    request_id = send(browser, "Thanks!", 16)
    shown = finished(browser, request_id)
    assert shown["finishReason"] != "tool_calls" and len(turns(browser)) == 3
    sent = requests.wait_for(lambda m: m.json()["requestId"] == request_id).json()
    assert sent["tools"] == [LOCAL_TIME_TOOL] and "toolChoice" not in sent
    first_request = requests.wait_for(lambda m: m.json()["requestId"] == asked["requestId"]).json()
    assert first_request["tools"] == [LOCAL_TIME_TOOL]
    assert first_request["toolChoice"] == {"type": "function", "function": {"name": "get_local_time"}}
    # The tool round survives a reload as it was shown.
    browser.refresh()
    wait(browser, lambda d: d.find_element("id", "send").is_enabled(), "reconnected after the reload")
    assert [(t["kind"], t["calls"], t["results"]) for t in turns(browser)] == [
        ("message", asked["calls"], []),
        ("results", [], answered["results"]),
        ("message", [], []),
    ]
    assert console_errors(browser) == []
    requests.close()
