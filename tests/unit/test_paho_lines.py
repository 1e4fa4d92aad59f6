"""paho's per-packet DEBUG lines are formatted only where the worker logs at DEBUG: paho
formats each line (a packet's properties too) before its log callback can drop it, on the
event loop's thread for everything the worker publishes. Its warnings and errors always pass."""

from __future__ import annotations

from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from worker.config.models import WorkerConfig
from worker.protocol.topics import Topics
from worker.transport.mqtt import MqttSettings, _ChunkReadingClient


class Formatted:
    """An argument of a log line that records whether the line was formatted."""

    def __init__(self) -> None:
        self.formatted = 0

    def __str__(self) -> str:
        self.formatted += 1
        return "properties"


@pytest.mark.parametrize("packet_log", [True, False])
def test_packet_lines_are_formatted_only_where_they_are_logged(packet_log: bool) -> None:
    client = _ChunkReadingClient(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5, packet_log=packet_log)
    lines: list[tuple[int, str]] = []

    def on_log(client: Any, userdata: Any, level: int, text: str) -> None:
        lines.append((level, text))

    client.on_log = on_log
    argument = Formatted()
    client._easy_log(mqtt.MQTT_LOG_DEBUG, "Received PUBLISH, properties=%s", argument)
    client._easy_log(mqtt.MQTT_LOG_WARNING, "a warning, %s", "kept")
    client._easy_log(mqtt.MQTT_LOG_ERR, "an error, %s", "kept")
    debug = [(mqtt.MQTT_LOG_DEBUG, "Received PUBLISH, properties=properties")] if packet_log else []
    assert lines == [*debug, (mqtt.MQTT_LOG_WARNING, "a warning, kept"), (mqtt.MQTT_LOG_ERR, "an error, kept")]
    assert argument.formatted == (1 if packet_log else 0)


@pytest.mark.parametrize(("level", "packet_log"), [("TRACE", True), ("DEBUG", True), ("INFO", False), ("ERROR", False)])
def test_the_worker_logs_pahos_packets_at_debug_only(level: str, packet_log: bool) -> None:
    config = WorkerConfig.model_validate({"engine": {"model": "m"}, "logging": {"level": level}})
    settings = MqttSettings.from_config(config, Topics(config.mqtt.topic_prefix), "w")
    assert settings.packet_log is packet_log
