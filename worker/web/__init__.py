"""The browser chat page (``worker/web/static``) and a small static server for it.

The page is a plain MQTT client of the worker's contract (docs/protocol.md): it talks to the
broker over MQTT over WebSockets with MQTT.js, logged in as the user, so the broker's ACL
(docs/security.md) is all that keeps users apart. This server only hands out the page's
files; it never sees a message. ``python -m worker.web``; docs/frontend.md describes the page.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

from loguru import logger

STATIC_DIR = Path(__file__).resolve().parent / "static"

# The page loads nothing but its own files and talks to nothing but a broker's WebSocket.
# worker-src blob:: MQTT.js runs its keepalive timers in a Web Worker made from a blob (the
# timers of a background tab are throttled, down to one a minute, which would miss keepalives);
# without it Chromium blocks that worker and logs a CSP violation.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src ws: wss:; worker-src blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class PageHandler(http.server.SimpleHTTPRequestHandler):
    """The files of the page's directory, read-only, with no directory listings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, directory=str(STATIC_DIR), **kwargs)

    def end_headers(self) -> None:
        self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-cache")
        super().end_headers()

    def list_directory(self, path: str | os.PathLike[str]) -> None:
        self.send_error(404, "Not found")
        return None

    def log_message(self, format: str, *args: Any) -> None:
        # The request line is the client's string: DEBUG only.
        logger.debug("web: {} {}", self.address_string(), format % args)


class PageServer(http.server.ThreadingHTTPServer):
    daemon_threads = True


class PageServer6(PageServer):
    address_family = socket.AF_INET6


def page_url(host: str, port: int, broker_url: str | None = None) -> str:
    """The page's address; with ``broker_url`` the page's broker field comes filled in."""
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    return url + f"?broker={quote(broker_url, safe='')}" if broker_url else url


def start(host: str = "127.0.0.1", port: int = 0) -> tuple[PageServer, threading.Thread]:
    """Serve the page on a thread; ``server.server_address`` has the port (0: a free one)."""
    server = (PageServer6 if ":" in host else PageServer)((host, port), PageHandler)
    thread = threading.Thread(target=server.serve_forever, name="web", daemon=True)
    thread.start()
    return server, thread
