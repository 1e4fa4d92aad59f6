"""``python -m worker.web``: serve the chat page (worker/web/static) until Ctrl-C."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from loguru import logger

from worker.config.loader import SuggestingParser
from worker.web import STATIC_DIR, page_url, start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = SuggestingParser(
        prog="python -m worker.web",
        description="Serve the browser chat page. The page talks to the broker itself, over MQTT over "
        "WebSockets, logged in with the user's own MQTT credentials (docs/frontend.md).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--broker-url",
        default=None,
        help="the broker's MQTT-over-WebSockets address to fill in on the page, e.g. ws://127.0.0.1:9001",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="{time:HH:mm:ss} {level} {message}")
    try:
        server, thread = start(args.host, args.port)
    except OSError as exc:
        print(f"cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    try:
        loopback = ipaddress.ip_address(str(host)).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        logger.warning("Listening on {}, not on loopback: anyone who reaches it gets the page", host)
    logger.info("Serving {} on {} (Ctrl-C to stop)", STATIC_DIR, page_url(str(host), int(port), args.broker_url))
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    logger.info("Stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
