"""The log lines docs/operations.md quotes for a broker that goes away are the ones the worker
writes: the quoted text is read from the page, so a changed message fails here until the page
says it too."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

from loguru import logger

from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import probe_settings
from devtools.waiting import eventually
from worker.transport.mqtt import MqttTransport

REPO = Path(__file__).resolve().parents[2]


def documented_lines(title: str) -> list[str]:
    """The quoted log lines (`MQTT ...`) of the troubleshooting entry with this bold title."""
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    entry = text.split(f"- **{title}**", 1)[1].split("\n- **", 1)[0]
    return [quote for quote in re.findall(r"`([^`]+)`", " ".join(entry.split())) if quote.startswith("MQTT ")]


def pattern(quoted: str) -> re.Pattern[str]:
    """HOST:PORT and ... in the documentation stand for any text."""
    parts = re.split(r"(HOST:PORT|\.\.\.)", quoted)
    return re.compile("^" + "".join(".+" if part in ("HOST:PORT", "...") else re.escape(part) for part in parts) + "$")


def test_a_broker_that_goes_away_is_told_as_the_troubleshooting_page_says(tmp_path: Path) -> None:
    quoted = documented_lines("The broker goes away while the worker runs.")
    # The network-drop line needs a connection reset, which a stopped broker does not give.
    expected = [line for line in quoted if " lost: " not in line]
    assert len(expected) >= 3, quoted
    records: list[str] = []
    sink = logger.add(lambda m: records.append(m.record["message"]), level="INFO")
    broker = Mosquitto(tmp_path)
    broker.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    transport = MqttTransport(probe_settings(broker.port), loop)
    try:
        transport.start()
        eventually(lambda: transport.connected, lambda: str(records))
        broker.stop()
        # A reconnect attempt while it is away.
        eventually(lambda: any("failed" in line for line in records), lambda: str(records))
        broker.restart()
        eventually(lambda: sum(line.startswith("MQTT connected") for line in records) >= 2, lambda: str(records))
    finally:
        asyncio.run_coroutine_threadsafe(transport.close(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        logger.remove(sink)
        broker.stop()
    missing = [line for line in expected if not any(pattern(line).match(record) for record in records)]
    assert not missing, records
