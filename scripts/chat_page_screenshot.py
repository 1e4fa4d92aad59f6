"""Makes docs/chat-page.png: the chat page in headless Chromium (Selenium), a short conversation
with a running worker through a broker's WebSockets listener.

    python scripts/chat_page_screenshot.py --broker-url ws://127.0.0.1:9001 docs/chat-page.png

Needs Debian's chromium and chromium-driver and the test extra's selenium (scripts/setup.sh).
The docs' picture: SmolLM2-135M-Instruct on the CPU (``--dtype float32 --block-size 32``),
at temperature 0 (this small model's answers are much better greedy).
"""

from __future__ import annotations

import argparse
import tempfile
import uuid

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

from worker.web import page_url, start

QUESTIONS = ["What is the capital of France?", "What is it famous for?", "Write a haiku about it."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output")
    parser.add_argument("--broker-url", default="ws://127.0.0.1:9001")
    parser.add_argument("--user", default="alice")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    server, _ = start("127.0.0.1", 0)
    port = int(server.server_address[1])
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"):
        options.add_argument(flag)
    options.add_argument("--window-size=900,900")
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path="/usr/bin/chromedriver"))
    try:
        session = "demo-" + uuid.uuid4().hex[:8]
        driver.get(f"{page_url('127.0.0.1', port, args.broker_url)}&user={args.user}&session={session}")
        driver.find_element("id", "connect").click()
        wait = WebDriverWait(driver, 300, poll_frequency=0.1)
        wait.until(lambda d: d.find_element("id", "send").is_enabled())
        wait.until(lambda d: "online" in d.find_element("id", "worker-status").text)
        driver.find_element("css selector", "#options summary").click()
        for field_id, value in (("max-tokens", args.max_tokens), ("temperature", args.temperature)):
            field = driver.find_element("id", field_id)
            field.clear()
            field.send_keys(str(value))
        driver.find_element("css selector", "#options summary").click()
        for i, question in enumerate(QUESTIONS, 1):
            driver.find_element("id", "message").send_keys(question + "\n")
            wait.until(
                lambda d, n=i: len(d.find_elements("css selector", "article.turn:not([data-status='pending'])")) == n
            )
        driver.save_screenshot(args.output)
    finally:
        driver.quit()
        server.shutdown()


if __name__ == "__main__":
    main()
