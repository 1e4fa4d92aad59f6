"""The chat page's images: attached with the file picker or by pasting, shown as thumbnails
before sending and in the transcript, sent as OpenAI content parts with data: URLs that the
worker's own parser takes back to the file's bytes; a file that is not an image is said and
not attached. In headless Chromium on a real mosquitto; a pretend worker (a retained
``online`` status) lets the page send, and the requests are read off the broker."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from devtools.browser import console_errors, open_page, wait
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.mqtt_client import pretend_worker as pretend_worker_on
from worker.protocol.images import ImageLimits
from worker.protocol.messages import parse_chat_request

PREFIX = "webimages"


@pytest.fixture
def requests(broker: Mosquitto) -> Iterator[Client]:
    with pretend_worker_on(broker.port, PREFIX) as watch:
        yield watch


def picture(color: tuple[int, int, int], fmt: str = "PNG", size: tuple[int, int] = (300, 200)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt)
    return out.getvalue()


def thumbs(browser: Any, selector: str) -> list[int]:
    """The natural widths of the thumbnails under ``selector`` (0: not drawn)."""
    widths: list[int] = browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map((img) => img.complete ? img.naturalWidth : 0)",
        selector,
    )
    return widths


PASTE = """
const [name, type, b64] = arguments;
const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
const data = new DataTransfer();
data.items.add(new File([bytes], name, { type }));
const paste = new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true });
document.getElementById("message").dispatchEvent(paste);
"""


def test_an_image_picked_or_pasted_goes_with_the_message_and_shows_as_a_thumbnail(
    page_server: str, browser: Any, broker: Mosquitto, requests: Client, tmp_path: Path
) -> None:
    assert broker.ws_port is not None
    session = "s-images"
    open_page(browser, page_server, broker.ws_port, "webuser", session, prefix=PREFIX)
    browser.find_element("id", "connect").click()
    wait(browser, lambda d: d.find_element("id", "attach").is_enabled(), "subscribed", 30)

    # Not an image: said, nothing attached.
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    browser.find_element("id", "image-file").send_keys(str(notes))
    wait(browser, lambda d: d.find_element("id", "attach-problem").is_displayed(), "the problem said", 10)
    assert "notes.txt is not a JPEG, PNG" in browser.find_element("id", "attach-problem").text
    assert not browser.find_element("id", "attachments").is_displayed()

    # Picked with the file picker: a thumbnail before sending.
    door = tmp_path / "door.jpg"
    door.write_bytes(picture((200, 40, 40), "JPEG"))
    browser.find_element("id", "image-file").send_keys(str(door))
    wait(browser, lambda d: thumbs(d, "#attachments img.thumb") == [128], "the attached image's thumbnail", 10)
    assert not browser.find_element("id", "attach-problem").is_displayed()
    browser.find_element("id", "message").send_keys("Who is at the door?\n")
    message = requests.wait_for(lambda m: m.topic == f"{PREFIX}/webuser/{session}/request", timeout=30)
    request = json.loads(message.payload)
    assert request["message"] == [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(door.read_bytes()).decode()},
        },
        {"type": "text", "text": "Who is at the door?"},
    ]
    parsed = parse_chat_request(message.payload, session, 65536, ImageLimits(4 << 20, 4))
    assert (parsed.message, [i.data for i in parsed.image_inputs]) == ("Who is at the door?", [door.read_bytes()])
    # In the transcript: the thumbnail with the text; the composer is empty again.
    wait(browser, lambda d: thumbs(d, "#transcript .bubble.user img.thumb") == [128], "the sent image's thumbnail", 10)
    assert browser.find_element("css selector", "#transcript .bubble.user").text == "Who is at the door?"
    assert not browser.find_element("id", "attachments").is_displayed()
    # The reply's image tokens are counted apart.
    requests.publish(
        f"{PREFIX}/webuser/{session}/reply",
        {
            "sessionId": session,
            "requestId": request["requestId"],
            "reply": "Nobody.",
            "finishReason": "stop",
            "usage": {"promptTokens": 400, "completionTokens": 3, "cachedTokens": 0, "imageTokens": 380},
            "latency": {"queueMs": 1.0, "ttftMs": 50.0, "totalMs": 900.0},
        },
    )
    meta = "#transcript article .meta"
    wait(
        browser,
        lambda d: "400 prompt tokens (0 cached, 380 of images)" in d.find_element("css selector", meta).text,
        "usage",
        10,
    )

    # Pasted into the message box, and sent without text.
    pasted = picture((0, 0, 220), "PNG", (40, 80))
    browser.execute_script(PASTE, "image.png", "image/png", base64.b64encode(pasted).decode())
    # 40 x 80: a thumbnail is never larger than its image.
    wait(browser, lambda d: thumbs(d, "#attachments img.thumb") == [40], "the pasted image's thumbnail", 10)
    browser.find_element("id", "send").click()
    second = requests.wait_for(lambda m: m.topic == f"{PREFIX}/webuser/{session}/request", timeout=30)
    assert json.loads(second.payload)["message"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(pasted).decode()}}
    ]
    assert [
        i.data for i in parse_chat_request(second.payload, session, 65536, ImageLimits(4 << 20, 4)).image_inputs
    ] == [pasted]
    wait(browser, lambda d: thumbs(d, "#transcript .bubble.user img.thumb") == [128, 40], "both thumbnails", 10)

    # A reload keeps the transcript's thumbnails (small copies, in localStorage).
    browser.refresh()
    wait(
        browser, lambda d: thumbs(d, "#transcript .bubble.user img.thumb") == [128, 40], "thumbnails after a reload", 30
    )
    assert console_errors(browser) == []
