"""Makes the chat page's pictures for the docs: the page in headless Chromium (Selenium), a short
conversation with a running worker through a broker's WebSockets listener, saved as a PNG.

    python scripts/chat_page_screenshot.py --broker-url ws://127.0.0.1:9001 docs/chat-page.png
    scripts/tools-demo.sh --screenshot docs/chat-page-tools.png   # a round of the worker's tools
    scripts/tools-demo.sh --vision --screenshot docs/chat-page-image.png   # an image in the turn

Needs Debian's chromium and chromium-driver and the test extra's selenium (scripts/setup.sh).
The docs' pictures: SmolLM2-135M-Instruct on the CPU (``--dtype float32 --block-size 32``),
at temperature 0 (this small model's answers are much better greedy). ``--worker-tools`` ticks
"Use the worker's tools" and ``--tool-choice NAME`` forces that tool, one for each ``--message``
(the demo model calls one only when forced); tools-demo.sh passes them with a worker that has
tools. ``--image FILE`` attaches a picture to the first message with the page's file picker
(a worker on a vision model: tools-demo.sh --vision, the tiny random-weight one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from devtools.browser import chromium, served_page, wait
from worker.web import page_url

QUESTIONS = ["What is the capital of France?", "What is it famous for?", "Write a haiku about it."]
PATIENCE = 300.0  # a reply of the CPU demo model on a busy 2-core machine: seconds to a minute


def set_field(driver: Any, field_id: str, value: object) -> None:
    field = driver.find_element("id", field_id)
    field.clear()
    field.send_keys(str(value))


def set_options(driver: Any, args: argparse.Namespace) -> None:
    """The page's Options, then folded again (the picture shows the conversation)."""
    driver.find_element("css selector", "#options summary").click()
    set_field(driver, "max-tokens", args.max_tokens)
    set_field(driver, "temperature", args.temperature)
    if args.system_prompt:
        set_field(driver, "system-prompt", args.system_prompt)
    if args.worker_tools:
        driver.find_element("id", "use-worker-tools").click()
    driver.find_element("css selector", "#options summary").click()


def force_tool(driver: Any, name: str) -> None:
    """Options' Tool choice: force the tool named ``name`` (the page sends it with each message)."""
    from selenium.webdriver.support.select import Select

    driver.find_element("css selector", "#options summary").click()
    Select(driver.find_element("id", "tool-choice")).select_by_value("named")
    set_field(driver, "forced-tool-name", name)
    driver.find_element("css selector", "#options summary").click()


def thumbnails_drawn(driver: Any, selector: str) -> bool:
    """Every thumbnail under ``selector`` is loaded and drawn (and there is one)."""
    drawn: bool = driver.execute_script(
        "const imgs = [...document.querySelectorAll(arguments[0])];"
        "return imgs.length > 0 && imgs.every((img) => img.complete && img.naturalWidth > 0);",
        selector,
    )
    return drawn


def attach(driver: Any, image: Path) -> None:
    """The page's file picker takes ``image``; returns once its thumbnail is drawn."""
    driver.find_element("id", "image-file").send_keys(str(image.resolve()))
    wait(driver, lambda d: thumbnails_drawn(d, "#attachments img.thumb"), f"{image.name} attached", 30)


def settled_turns(driver: Any) -> int:
    """How many turns the page shows with their reply ended (not pending)."""
    return len(driver.find_elements("css selector", "article.turn:not([data-status='pending'])"))


def has_settled(driver: Any, count: int) -> bool:
    return settled_turns(driver) == count


def save_small(driver: Any, output: str) -> None:
    """The screenshot as an optimised palette PNG: a text page keeps its look in 256 colours,
    at about a third of the bytes of Chromium's RGB PNG."""
    from io import BytesIO

    from PIL import Image

    image = Image.open(BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(output, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output")
    parser.add_argument("--broker-url", default="ws://127.0.0.1:9001")
    parser.add_argument("--user", default="alice")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--system-prompt", default="")
    parser.add_argument("--worker-tools", action="store_true", help='tick "Use the worker\'s tools"')
    parser.add_argument(
        "--tool-choice",
        metavar="NAME",
        action="append",
        help="force this tool's call in the first round of a message (repeatable: one for each --message)",
    )
    parser.add_argument("--message", action="append", help="a message to send (repeatable; default: three questions)")
    parser.add_argument(
        "--image", type=Path, metavar="FILE", help="attach this picture to the first message (a vision model's worker)"
    )
    parser.add_argument("--window-size", default="900,900", help="WIDTH,HEIGHT of the browser window")
    args = parser.parse_args()
    width, height = (int(n) for n in args.window_size.split(","))

    with served_page() as page, chromium(Path(tempfile.mkdtemp(prefix="chromium-"))) as driver:
        driver.set_window_size(width, height)
        host, port = page.removeprefix("http://").rsplit(":", 1)
        query = urlencode({"user": args.user, "session": "demo-" + uuid.uuid4().hex[:8]})
        driver.get(f"{page_url(host, int(port), args.broker_url)}&{query}")
        driver.find_element("id", "connect").click()
        wait(driver, lambda d: d.find_element("id", "send").is_enabled(), "subscribed", PATIENCE)
        wait(driver, lambda d: "online" in d.find_element("id", "worker-status").text, "the worker", PATIENCE)
        set_options(driver, args)
        for i, question in enumerate(args.message or QUESTIONS, 1):
            if args.tool_choice:  # the i-th message's, the last one's for those after it
                force_tool(driver, args.tool_choice[min(i, len(args.tool_choice)) - 1])
            if args.image is not None and i == 1:
                attach(driver, args.image)
            driver.find_element("id", "message").send_keys(question + "\n")
            wait(driver, partial(has_settled, count=i), f"reply {i}", PATIENCE)
        if args.image is not None:
            wait(driver, lambda d: thumbnails_drawn(d, "#transcript img.thumb"), "the turn's thumbnail", 30)
        save_small(driver, args.output)


if __name__ == "__main__":
    main()
