"""Fixtures of the chat page's browser tests: the page's static server and one headless
Chromium per module (devtools/browser.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from devtools.browser import chromium, served_page


@pytest.fixture(scope="module")
def page_server() -> Iterator[str]:
    with served_page() as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver
