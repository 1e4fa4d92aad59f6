"""Credentials and TLS (issue 5, points 1 and 2) against a real mosquitto that the test
configures: a password file with anonymous access off, and a TLS listener whose CA, server
certificate and client certificate are generated with openssl at run time.

The worker is the in-process Service and real MqttTransport (devtools/inproc.py). Where it must
not connect, the transport is started alone and watched until its log says why it was refused
(paho tries again in the background, to no avail): the test checks that it is not connected,
reads the log and closes.
The frontend uses the broker's plain listener: the broker routes between listeners."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from loguru import logger
from paho.mqtt.enums import CallbackAPIVersion

from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto, password_file
from devtools.mqtt_client import Client, probe_settings
from devtools.net import free_port
from devtools.pki import Pki, make_pki, tls_listener
from devtools.waiting import PATIENCE, eventually
from worker.transport.mqtt import MqttTransport


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class TlsBroker:
    broker: Mosquitto
    tls_port: int  # server certificate only
    mtls_port: int  # requires a client certificate; its CN is the MQTT username
    misnamed_port: int  # a certificate from the right CA that names another host


@pytest.fixture(scope="module")
def tls_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    tls_port, mtls_port, misnamed_port = free_port(), free_port(), free_port()
    extra = (
        tls_listener(tls_port, pki)
        + tls_listener(mtls_port, pki)
        + "require_certificate true\nuse_identity_as_username true\n"
        + f"listener {misnamed_port} 127.0.0.1\ncafile {pki.ca}\n"
        + f"certfile {pki.misnamed_cert}\nkeyfile {pki.misnamed_key}\n"
    )
    # keep_root: the broker (root here) reads the 0600 keys in pytest's 0700 directories.
    broker = Mosquitto(tmp_path_factory.mktemp("tls-broker"), extra, keep_root=True, autosave="default")
    broker.start()
    yield TlsBroker(broker, tls_port, mtls_port, misnamed_port)
    broker.stop()


@pytest.fixture
def frontend(tls_broker: TlsBroker) -> Iterator[Client]:
    client = Client(tls_broker.broker.port, ["+/+/+/reply"])
    yield client
    client.close()


def _round_trip(live: LiveWorker, frontend: Client) -> None:
    frontend.publish(live.topic("bob", "s1"), {"message": "hello", "maxTokens": 3, "requestId": "r1"})
    reply = frontend.wait_topic(live.topic("bob", "s1", "reply"), 15).json()
    assert reply.get("requestId") == "r1" and "error" not in reply, reply


def test_the_worker_serves_over_tls_with_the_right_ca(tls_broker: TlsBroker, pki: Pki, frontend: Client) -> None:
    live = LiveWorker(tls_broker.tls_port, mqtt={"tls_ca_file": pki.ca})
    try:
        sock = live.transport._client.socket()
        assert isinstance(sock, socket.socket)
        assert sock.__class__.__name__ == "SSLSocket"
        # set_tcp_nodelay works on the TLS socket (an ssl.SSLSocket is a socket.socket).
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        _round_trip(live, frontend)
    finally:
        live.close()


def watch_connect(settings: dict[str, Any], refused: str | None = None) -> tuple[bool, str]:
    """Start a bare transport and watch it until it has connected, or until its log says
    ``refused`` (paho tries again after that, with the same settings, to no avail): (connected,
    log). An event either way, not a few seconds that a loaded machine may need for a TLS
    handshake."""
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="DEBUG", format="{level} {message}")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    transport = MqttTransport(probe_settings(**settings), loop)

    def connected() -> bool:
        return transport.connected or transport._subscribed.is_set()

    try:
        transport.start()
        eventually(
            lambda: connected() or (refused is not None and refused in "\n".join(lines)),
            lambda: "neither connected nor refused: " + "\n".join(lines[-20:]),
        )
        connected_now = connected()
        return connected_now, "\n".join(lines)
    finally:
        asyncio.run_coroutine_threadsafe(transport.close(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        logger.remove(sink)


def test_a_server_certificate_from_another_ca_is_refused(tls_broker: TlsBroker, pki: Pki) -> None:
    connected, log = watch_connect(
        {"port": tls_broker.tls_port, "tls_ca_file": pki.other_ca}, "certificate verify failed"
    )
    assert not connected
    assert "certificate verify failed" in log, log
    # The right CA on the same listener connects: the refusal was the certificate's.
    connected, _ = watch_connect({"port": tls_broker.tls_port, "tls_ca_file": pki.ca})
    assert connected


def test_client_certificate_authentication(
    tls_broker: TlsBroker, pki: Pki, frontend: Client, caplog: pytest.LogCaptureFixture
) -> None:
    # Without a client certificate the broker ends the connection with a TLS alert (under
    # TLS 1.3 the client sees it on its first read, which the transport logs as a lost connection).
    connected, log = watch_connect({"port": tls_broker.mtls_port, "tls_ca_file": pki.ca}, "certificate required")
    assert not connected
    assert "certificate required" in log and "ERROR" not in log, log
    live = LiveWorker(
        tls_broker.mtls_port,
        mqtt={"tls_ca_file": pki.ca, "tls_cert_file": pki.client_cert, "tls_key_file": pki.client_key},
    )
    try:
        _round_trip(live, frontend)
    finally:
        live.close()
    assert "tls-worker" in tls_broker.broker.log.read_text()  # the certificate's CN, as its username


def test_the_hostname_override_warns(tls_broker: TlsBroker, pki: Pki) -> None:
    """A certificate from the right CA for another host: the name check refuses it, and the
    tests-only override accepts it with a warning."""
    settings = {"port": tls_broker.misnamed_port, "tls_ca_file": pki.ca}
    connected, log = watch_connect(settings, "IP address mismatch")
    assert not connected and "IP address mismatch" in log, log
    connected, log = watch_connect(settings | {"tls_insecure_skip_hostname_check": True})
    assert connected and "WARNING MQTT TLS: the broker's host name is not checked" in log, log


@pytest.fixture
def password_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    passwords = password_file(tmp_path / "passwd", {"worker": "right-pass", "frontend": "front-pass"})
    # The later allow_anonymous overrides the helper's "allow_anonymous true".
    broker = Mosquitto(tmp_path, f"password_file {passwords}\nallow_anonymous false\n", keep_root=True)
    broker.start()
    yield broker
    broker.stop()


def test_password_authentication(password_broker: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A wrong password and no login are refused (the worker logs it and never subscribes);
    the right one, read from a file, is served. No password reaches a log."""
    port = password_broker.port
    connected, log = watch_connect(
        {"port": port, "username": "worker", "password": "wrong-pass"}, "MQTT connect refused"
    )
    assert not connected and "MQTT connect refused" in log, log
    assert "wrong-pass" not in log
    connected, log = watch_connect({"port": port}, "MQTT connect refused")  # anonymous
    assert not connected and "MQTT connect refused" in log, log

    password_file = tmp_path / "worker-password"
    password_file.write_text("right-pass\n")
    live = LiveWorker(port, mqtt={"username": "worker", "password_file": password_file})
    raw = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    raw.username_pw_set("frontend", "front-pass")
    replies: list[bytes] = []
    subscribed = threading.Event()
    raw.on_message = lambda c, u, m: replies.append(bytes(m.payload))
    raw.on_subscribe = lambda *args: subscribed.set()
    try:
        raw.connect("127.0.0.1", port)
        raw.loop_start()
        raw.subscribe("+/+/+/reply", qos=1)
        assert subscribed.wait(PATIENCE), "no SUBACK"
        raw.publish(live.topic("bob", "s1"), b'{"message": "hi", "maxTokens": 2, "requestId": "r1"}', qos=1)
        eventually(lambda: replies, "no reply")
        assert replies and b'"r1"' in replies[0] and b'"error"' not in replies[0], replies
    finally:
        raw.disconnect()
        raw.loop_stop()
        live.close()
    assert "pass" not in caplog.text, caplog.text
