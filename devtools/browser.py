"""The chat page (worker/web) in a real browser, for the tests: Debian's headless Chromium
driven by Selenium, the page served by ``worker.web`` on a thread. The page's tests with a real
engine are tests/engine/test_web.py; those with the in-process worker (no engine) are in
tests/broker/."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from worker.web import page_url, start

from .waiting import PATIENCE

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextlib.contextmanager
def served_page() -> Iterator[str]:
    """The page's address (``http://127.0.0.1:PORT``) while it is served."""
    server, thread = start("127.0.0.1", 0)
    host, port = server.server_address[:2]
    try:
        yield f"http://{host!s}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def chromium(profile: Path, timezone: str | None = None) -> Iterator[Any]:
    """A headless Chromium (a Selenium driver) with its profile in ``profile``; ``timezone``:
    the browser's own (TZ), for the page's local-time tool."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            raise RuntimeError(f"{path} is missing (apt-get install -y chromium chromium-driver; scripts/setup.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Headless as root on a machine with a closed network: without the background-networking
    # flags Chromium keeps trying to reach Google's hosts.
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1000,1250",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    env = {**os.environ, "TZ": timezone} if timezone else dict(os.environ)
    service = Service(executable_path=CHROMEDRIVER, env=env)
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = PATIENCE) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, f"waiting for {what}")


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """The browser's errors since the last call: scripts, CSP violations, failed loads."""
    entries: list[dict[str, Any]] = driver.get_log("browser")
    return [e for e in entries if e["level"] == "SEVERE"]


def open_page(driver: Any, page_server: str, broker_ws_port: int, user: str, session: str, **params: str) -> None:
    """The page for this user and session (``params``: more of its URL parameters, e.g.
    prefix), with nothing left in the browser's storage by an earlier test (the page would
    otherwise reconnect by itself, as after a reload)."""
    driver.get(page_server + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    console_errors(driver)  # what an earlier test left
    url = page_url("127.0.0.1", int(page_server.rsplit(":", 1)[1]), f"ws://127.0.0.1:{broker_ws_port}")
    driver.get(f"{url}&{urlencode({'user': user, 'session': session, **params})}")
