"""What paho's network thread costs the event loop in a burst, through the real broker: the
worker's client reads its socket in chunks (paho reads a packet a few bytes at a time, a
system call each that gives up the GIL and must win it back from the busy loop), and what
arrives while the loop is busy reaches it with one wake-up, not one per message."""

from __future__ import annotations

import fcntl
import json
import struct
import termios
import threading
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.waiting import PATIENCE, eventually
from worker.transport.mqtt import _ChunkReadingClient

BURST = 200


def test_a_burst_that_arrives_while_the_loop_is_busy_costs_few_reads_and_one_wake_up(
    broker: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = LiveWorker(broker.port, limits={"max_requests_per_user_per_minute": 0})
    frontend = Client(broker.port, [f"{live.prefix}/+/+/reply"])
    reads = [0]
    recv = mqtt.Client._sock_recv

    def counted(self: Any, bufsize: int) -> bytes:
        if isinstance(self, _ChunkReadingClient):  # the worker's, not the frontend's
            reads[0] += 1
        return recv(self, bufsize)  # type: ignore[no-any-return]

    wake_ups = [0]
    loop = live.loop
    wake = loop.call_soon_threadsafe

    def counted_wake(*args: Any, **kwargs: Any) -> Any:
        wake_ups[0] += 1
        return wake(*args, **kwargs)

    busy, free = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        busy.set()
        free.wait(PATIENCE)  # the loop's thread, busy: what paho's thread hands over waits

    client = live.transport._client
    on_message, gate, first = client.on_message, threading.Event(), threading.Event()

    def gated(*args: Any) -> None:  # paho's thread held at the first request: the rest piles up
        if not first.is_set():
            first.set()
            gate.wait(PATIENCE)
        on_message(*args)

    def unread() -> int:  # bytes in the worker's socket that paho has not read
        return struct.unpack("i", fcntl.ioctl(client._sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]

    try:
        client.on_message = gated
        monkeypatch.setattr(mqtt.Client, "_sock_recv", counted)
        monkeypatch.setattr(loop, "call_soon_threadsafe", counted_wake)
        loop.call_soon_threadsafe(hold_the_loop)
        assert busy.wait(PATIENCE)
        payload = {"message": "hello " * 100, "requestId": "r0"}
        for n in range(BURST):
            frontend.publish(live.topic("u", f"s{n}"), payload | {"requestId": f"r{n}"})
        assert first.wait(PATIENCE)
        eventually(lambda: unread() >= 50 * 600, "the rest of the burst waiting in the socket", 20)
        reads[0] = wake_ups[0] = 0
        gate.set()
        eventually(lambda: len(live.transport._handed) >= BURST, "every request read by paho, none taken yet", 20)
        read_while_busy, woken_while_busy = reads[0], wake_ups[0]
        free.set()
        replies = [json.loads(frontend.wait_for(lambda m: m.topic.endswith("/reply")).payload) for _ in range(BURST)]
        # paho alone: three to five reads a message (its type, each byte of its length, its body).
        assert read_while_busy < BURST // 4, read_while_busy
        assert woken_while_busy <= 1, woken_while_busy
        assert sorted(r["requestId"] for r in replies) == sorted(f"r{n}" for n in range(BURST))
    finally:
        gate.set()
        free.set()
        frontend.close()
        live.close()
