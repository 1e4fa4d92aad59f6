"""The broker is checked before the model load (transport.check_broker, server.broker_accepts):
a broker that is down, refuses the login or fails TLS is told in plain words within seconds,
with exit code 2, not after minutes of loading the model; the worker waits for it only where
asked to (--wait-for-broker) or under systemd. And paho's own ERROR lines while the broker is
away reach the log as plain WARNINGs. Against real mosquitto brokers; no engine is started:
each worker here exits, or is killed, before vLLM is imported."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from devtools.mosquitto import Mosquitto, password_file
from devtools.mqtt_client import probe_settings
from devtools.net import free_port
from devtools.pki import Pki, make_pki, tls_listener
from devtools.systemd import NotifyListener
from devtools.waiting import PATIENCE, eventually
from devtools.worker_process import WorkerProcess
from worker.config.models import nvidia_gpu_present
from worker.transport.mqtt import BrokerUnavailable, MqttSettings, MqttTransport, check_broker


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Passes the start's model check; never loaded (every worker here ends before that)."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (model / name).write_text("{}")
    return model


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def locked_broker(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[tuple[Mosquitto, int, int]]:
    """Logins by password on its plain port; TLS with the test CA's certificate on the other."""
    workdir = tmp_path_factory.mktemp("locked-broker")
    passwords = password_file(workdir / "passwd", {"worker": "right-pass"})
    tls_port, mtls_port = free_port(), free_port()
    # The later allow_anonymous overrides the helper's "allow_anonymous true".
    extra = (
        f"password_file {passwords}\nallow_anonymous false\n"
        + tls_listener(tls_port, pki)
        + tls_listener(mtls_port, pki)
        + "require_certificate true\n"
    )
    broker = Mosquitto(workdir, extra, keep_root=True, autosave="default")
    broker.start()
    yield broker, tls_port, mtls_port
    broker.stop()


def problem(s: MqttSettings, timeout: float = 5) -> BrokerUnavailable:
    with pytest.raises(BrokerUnavailable) as exc:
        check_broker(s, timeout)
    return exc.value


def test_the_check_says_what_is_wrong(locked_broker: tuple[Mosquitto, int, int], pki: Pki) -> None:
    broker, tls_port, mtls_port = locked_broker
    down = problem(probe_settings(free_port()))  # nothing listens there
    assert down.transient and "refused: no broker listens there" in down.problem, down.problem

    wrong = problem(probe_settings(broker.port, username="worker", password="wrong-pass"))
    assert not wrong.transient, wrong.problem
    # mosquitto 2.0.11 answers a wrong password with "Not authorized" (MQTT 5 has both codes).
    assert "refused the login: Not authorized; check mqtt.username and the password" in wrong.problem
    assert "wrong-pass" not in wrong.problem
    anonymous = problem(probe_settings(broker.port))
    assert not anonymous.transient and "refused the login: Not authorized" in anonymous.problem

    other_ca = problem(probe_settings(tls_port, tls_ca_file=pki.other_ca))
    assert not other_ca.transient and "TLS: the broker's certificate" in other_ca.problem, other_ca.problem
    assert "is not accepted (" in other_ca.problem and "check mqtt.tls_ca_file" in other_ca.problem
    plain_to_tls = problem(probe_settings(tls_port))  # no tls_ca_file: an MQTT CONNECT to a TLS listener
    assert "closed the connection without answering the login" in plain_to_tls.problem, plain_to_tls.problem
    assert "a TLS port (then set mqtt.tls_ca_file)" in plain_to_tls.problem
    no_certificate = problem(probe_settings(mtls_port, tls_ca_file=pki.ca))  # the broker wants a client's
    assert not no_certificate.transient, no_certificate.problem
    assert "ended the TLS connection before the login" in no_certificate.problem, no_certificate.problem
    assert "mqtt.tls_cert_file" in no_certificate.problem

    # The right login, and the right CA, pass; the check leaves no session behind (a clean
    # start with no expiry) and its own client id, never the worker's.
    check_broker(probe_settings(broker.port, username="worker", password="right-pass", client_id="w1"))
    check_broker(probe_settings(tls_port, tls_ca_file=pki.ca, username="worker", password="right-pass"))
    eventually(lambda: "Client w1-check disconnected" in broker.log.read_text(), lambda: broker.log.read_text()[-2000:])


def test_a_port_that_accepts_and_never_answers_is_told_apart() -> None:
    """Something listens, but not a broker that answers (or a TLS port without tls_ca_file)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        found = problem(probe_settings(silent.getsockname()[1]), timeout=0.5)
    assert found.transient and "did not answer the login within 0.5 s" in found.problem, found.problem


def start_worker(model: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> WorkerProcess:
    environment = {key: value for key, value in os.environ.items() if key != "NOTIFY_SOCKET"}
    return WorkerProcess(
        ["--model", str(model), "--store", "memory", *args],
        tmp_path / f"worker-{time.monotonic_ns()}.log",
        {**environment, **(env or {})},
    )


def test_a_broker_that_is_down_ends_the_start_before_the_model_load(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    worker = start_worker(model_dir, tmp_path, "--mqtt-port", str(port), "--visible-devices", "2")
    assert worker.proc.wait(PATIENCE) == 2
    log = worker.log()
    worker.stop()
    assert f"Cannot use the MQTT broker: connection to 127.0.0.1:{port} refused" in log, log
    assert "--wait-for-broker" in log
    assert "Importing vLLM" not in log and "Loading the tokenizer" not in log and "Listening on" not in log
    assert "Traceback" not in log
    if not nvidia_gpu_present():  # --visible-devices on a CPU machine is said, not ignored
        assert "--visible-devices 2 has no effect: this machine has no NVIDIA GPU" in log, log


def test_a_refused_login_ends_the_start_even_when_waiting(
    model_dir: Path, tmp_path: Path, locked_broker: tuple[Mosquitto, int, int]
) -> None:
    broker, _, _ = locked_broker
    worker = start_worker(
        model_dir,
        tmp_path,
        *("--mqtt-port", str(broker.port), "--mqtt-username", "worker", "--wait-for-broker"),
        env={"WORKER_MQTT_PASSWORD": "wrong-pass"},
    )
    assert worker.proc.wait(PATIENCE) == 2
    log = worker.log()
    worker.stop()
    assert "Cannot use the MQTT broker: the broker at 127.0.0.1" in log, log
    assert "refused the login: Not authorized; check mqtt.username" in log and "Waiting for" not in log, log
    assert "wrong-pass" not in log


def test_with_wait_for_broker_the_start_goes_on_once_the_broker_is_up(model_dir: Path, tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path)  # its port, not listening yet
    worker = start_worker(model_dir, tmp_path, "--mqtt-port", str(broker.port), "--wait-for-broker")
    try:
        worker.wait_log(re.escape(f"Waiting for the MQTT broker: connection to 127.0.0.1:{broker.port} refused"))
        broker.start()
        worker.wait_log("Importing vLLM")  # the model load begins once the broker answers
        log = worker.log()
        assert f"MQTT broker at 127.0.0.1:{broker.port} accepted the login" in log
        assert "ERROR" not in log, log
    finally:
        worker.signal_group(signal.SIGKILL)  # no engine is wanted here
        worker.stop(5)
        broker.stop()


def test_under_systemd_the_worker_waits_and_stops_cleanly_while_waiting(model_dir: Path, tmp_path: Path) -> None:
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    port = free_port()
    worker = start_worker(model_dir, tmp_path, "--mqtt-port", str(port), env={"NOTIFY_SOCKET": listener.address})
    try:
        worker.wait_log("Waiting for the MQTT broker")
        listener.wait_for(f"STATUS=Waiting for the MQTT broker: connection to 127.0.0.1:{port} refused")
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(PATIENCE) == 0
        assert "Stopped while waiting for the broker (exit code 0)" in worker.log()
    finally:
        worker.stop(5)
        listener.close()


def test_paho_errors_while_the_broker_is_away_are_plain_warnings(tmp_path: Path) -> None:
    """paho logs "Client is not connected. Socket: None). Last known Connection State: ..." at
    ERROR on every failed reconnect; the worker says what happened, at WARNING."""
    records: list[tuple[str, str]] = []
    sink = logger.add(lambda m: records.append((m.record["level"].name, m.record["message"])), level="DEBUG")
    broker = Mosquitto(tmp_path)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    transport = MqttTransport(probe_settings(broker.port), loop)
    try:
        transport.start()

        def tries() -> int:  # paho's failed reconnects
            return sum("Client is not connected" in text for _, text in list(records))

        eventually(lambda: tries() >= 2, lambda: str(records))  # two tries
        broker.start()
        eventually(lambda: transport.connected, lambda: str(records))
        broker.kill()  # the connection is lost: paho's "failed to receive on socket"
        eventually(lambda: not transport.connected, lambda: str(records))
        before = tries()
        eventually(lambda: tries() > before, lambda: str(records))  # a reconnect attempt, failed
    finally:
        asyncio.run_coroutine_threadsafe(transport.close(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        logger.remove(sink)
        broker.stop()
    assert not [r for r in records if r[0] == "ERROR"], records
    warnings = [text for level, text in records if level == "WARNING"]
    assert any(f"MQTT connection to 127.0.0.1:{broker.port} failed" in text for text in warnings), warnings
    assert all("Client is not connected" not in text for text in warnings), warnings
