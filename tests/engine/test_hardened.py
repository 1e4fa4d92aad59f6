"""Issue 5 on one real worker (vLLM CPU engine, tiny model), deployed the way docs/security.md
says, so that every point is tested together:

- it runs under bubblewrap with the root read-only and only what the systemd unit makes
  writable writable: its StateDirectory (also its working directory), its CacheDirectory, a
  private /tmp and /var/tmp (PrivateTmp), /dev/shm (ProtectSystem=strict leaves /dev alone);
  /home and /root are empty and read-only (ProtectHome), no capabilities
  (CapabilityBoundingSet=), the unit's Environment= lines with its two directories moved here;
- its settings are in a TOML file (WORKER_CONFIG, read-only), its password in the environment
  (the unit's EnvironmentFile);
- it logs in as ``worker`` over TLS to a mosquitto that this module configures with a TLS
  listener, passwords and the ACL of docs/security.md; the users log in on its plain listener;
- every limit of point 5 is set low, so that each test below hits one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devtools import REPO
from devtools.acl import documented_acl
from devtools.mosquitto import Mosquitto, password_file
from devtools.mqtt_client import Client, asking
from devtools.net import free_port
from devtools.pki import Pki, make_pki, tls_listener
from devtools.systemd import unit_settings
from devtools.waiting import PATIENCE, eventually
from devtools.worker_process import WorkerProcess, engine_args

USERS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace"]
SETTINGS: dict[str, dict[str, Any]] = {
    "limits": {"max_payload_bytes": 2048, "max_message_tokens": 64, "max_requests_per_user_per_minute": 10},
    "generation": {"max_tokens": 8, "max_tokens_limit": 16},
    "history": {"max_history_turns": 100, "max_history_tokens": 64, "max_sessions": 2, "session_ttl": 30},
    "stats": {"interval": 1},
}
pytestmark = pytest.mark.e2e
UNIT_STATE, UNIT_CACHE = "/var/lib/mqtt-vllm-worker", "/var/cache/mqtt-vllm-worker"


@dataclass
class Deployment:
    worker: WorkerProcess
    broker: Mosquitto
    tls_port: int
    passwords: dict[str, str]
    args: list[str]  # the worker's command line (its settings are in the config file)
    env: dict[str, str]  # the worker's environment (the unit's, moved here)
    state: Path
    writable: list[Path]  # everything the sandbox lets it write, state included

    def client(self, user: str, subscriptions: list[str] | None = None) -> Client:
        topics = subscriptions or [f"chat/{user}/+/reply"]
        return Client(self.broker.port, topics, login=(user, self.passwords[user]))

    def state_bytes(self) -> bytes:
        return b"".join(p.read_bytes() for p in sorted(self.state.rglob("*")) if p.is_file())


def toml(sections: dict[str, dict[str, Any]]) -> str:
    # JSON scalars and lists of strings are valid TOML values.
    return "".join(
        f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())
        for name, values in sections.items()
    )


def unit_environment(state: Path, cache: Path) -> dict[str, str]:
    """The unit's Environment= lines, its StateDirectory and CacheDirectory moved to the test's."""
    env: dict[str, str] = {}
    for line in unit_settings()["Environment"]:
        for assignment in line.split():
            key, value = assignment.split("=", 1)
            env[key] = value.replace(UNIT_CACHE, str(cache)).replace(UNIT_STATE, str(state))
    return env


def sandbox(readable: list[Path], writable: list[Path], tmp: Path, var_tmp: Path, cwd: Path) -> list[str]:
    """bubblewrap: the root read-only, then what the unit makes writable."""
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap is missing: run scripts/setup.sh (Debian package bubblewrap)"
    command = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--tmpfs", "/dev/shm", "--proc", "/proc"]
    homes = ("/home", "/root")  # ProtectHome=yes: empty, read-only (once what follows is in)
    for home in homes:
        command += ["--tmpfs", home]
    command += ["--bind", str(tmp), "/tmp", "--bind", str(var_tmp), "/var/tmp"]  # PrivateTmp=yes
    # What it reads (repository, virtual environment, model, certificates, config) may lie in
    # the paths just hidden: back, read-only. Parents first, so that none hides a child.
    for path in sorted(set(readable), key=lambda p: len(p.parts)):
        command += ["--ro-bind", str(path), str(path)]
    for path in writable:
        command += ["--bind", str(path), str(path)]
    for home in homes:
        command += ["--remount-ro", home]
    return [*command, "--cap-drop", "ALL", "--chdir", str(cwd), "--"]


@pytest.fixture(scope="module")
def deployment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("hardened")
    (base / "pki").mkdir()
    pki: Pki = make_pki(base / "pki")
    passwords = {name: f"{name}-{secrets.token_hex(8)}" for name in ["worker", "monitor", *USERS]}
    acl = base / "acl"
    acl.write_text(documented_acl())
    tls_port = free_port()
    broker_dir = base / "broker"
    broker_dir.mkdir()
    broker = Mosquitto(
        broker_dir,
        f"allow_anonymous false\npassword_file {password_file(base / 'passwd', passwords)}\nacl_file {acl}\n"
        + tls_listener(tls_port, pki),
        keep_root=True,  # root reads the keys and files in pytest's 0700 directories
        autosave="default",
    )
    broker.start()

    dirs = {name: base / name for name in ["state", "cache", "tmp", "var-tmp", "etc"]}
    for path in dirs.values():
        path.mkdir()
    config = dirs["etc"] / "worker.toml"
    mqtt = {"host": "127.0.0.1", "port": tls_port, "username": "worker", "tls_ca_file": str(pki.ca)}
    config.write_text(toml({"mqtt": mqtt | {"topic_prefix": "chat", "worker_id": "gpu-1"}, **SETTINGS}))
    env = unit_environment(dirs["state"], dirs["cache"]) | {
        "WORKER_CONFIG": str(config),
        "WORKER_MQTT_PASSWORD": passwords["worker"],  # what the unit's EnvironmentFile holds
        "HOME": "/",  # a DynamicUser's
    }
    writable = [dirs["state"], dirs["cache"]]
    readable = [REPO, Path(sys.prefix), Path(sys.base_prefix), tiny_model, pki.ca.parent, dirs["etc"]]
    wrapper = sandbox(readable, writable, dirs["tmp"], dirs["var-tmp"], cwd=dirs["state"])
    # The unit's ExecStart is `python -m worker`, its [engine] settings in worker.toml: the
    # engine flags stand in for them.
    args = engine_args(tiny_model)
    worker = WorkerProcess(args, base / "worker.log", env, wrapper=wrapper, cwd=dirs["state"])
    watcher = Client(broker.port, ["chat/_worker/gpu-1/status"], login=("monitor", passwords["monitor"]))
    try:
        deadline = time.monotonic() + 400
        while True:
            try:
                watcher.wait_for(lambda m: m.payload == b"online", timeout=2)
                break
            except TimeoutError:
                if not worker.alive() or time.monotonic() > deadline:
                    worker.stop(5)
                    broker.stop()
                    raise RuntimeError(f"the sandboxed worker did not come online:\n{worker.log()[-6000:]}") from None
    finally:
        watcher.close()
    everything_writable = [*writable, dirs["tmp"], dirs["var-tmp"]]
    yield Deployment(worker, broker, tls_port, passwords, args, env, dirs["state"], everything_writable)
    # bwrap does not pass signals on: SIGTERM to the worker itself, a graceful stop.
    children = Path(f"/proc/{worker.proc.pid}/task/{worker.proc.pid}/children").read_text().split()
    os.kill(int(children[0]), signal.SIGTERM)
    code = worker.proc.wait(PATIENCE)  # bwrap exits with its child's code
    worker.stop(5)
    broker.stop()
    print(worker.log()[-3000:])
    assert code == 0, f"the sandboxed worker exited with {code}"


def ask(client: Client, user: str, session: str, payload: dict[str, Any], timeout: float = PATIENCE) -> dict[str, Any]:
    client.publish(f"chat/{user}/{session}/request", payload)
    answer: dict[str, Any] = client.wait_topic(f"chat/{user}/{session}/reply", timeout).json()
    return answer


def code_of(answer: dict[str, Any]) -> str | None:
    error = answer.get("error")
    return str(error["code"]) if error else None


def test_it_serves_over_tls_under_a_read_only_root_writing_only_where_the_unit_allows(
    deployment: Deployment,
) -> None:
    alice = deployment.client("alice")
    try:
        answer = ask(alice, "alice", "s1", {"message": "hello there", "maxTokens": 4, "requestId": "a1"})
    finally:
        alice.close()
    assert code_of(answer) is None and answer["requestId"] == "a1", answer
    # It logged in as worker, on the TLS listener: first the start's check of the broker (a
    # client id of its own, a clean session), then for good (its persistent session).
    broker_log = deployment.broker.log.read_text()
    tls_ports = re.findall(rf"New connection from 127\.0\.0\.1:(\d+) on port {deployment.tls_port}\.", broker_log)
    assert tls_ports, broker_log[-3000:]
    logins = [f"127.0.0.1:{port} as gpu-1" for port in tls_ports]
    assert any(f"{login}-check (p5, c1, k30, u'worker')" in broker_log for login in logins), broker_log[-3000:]
    assert any(f"{login} (p5, c0, k30, u'worker')" in broker_log for login in logins), broker_log[-3000:]
    # The sandbox held: the worker's root is read-only, its state directory writable.
    pid = Path(f"/proc/{deployment.worker.proc.pid}/task/{deployment.worker.proc.pid}/children").read_text().split()[0]
    mounts = {line.split()[4]: line.split()[5] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
    assert mounts["/"].split(",")[0] == "ro" and mounts[str(deployment.state)].split(",")[0] == "rw", mounts
    assert mounts["/root"].split(",")[0] == "ro"
    # Nothing it does needed to write elsewhere. A refused write is logged: without the unit's
    # VLLM_CACHE_ROOT, vLLM logs the ERROR "Error saving model info cache" ("Read-only file
    # system: '/.cache'") and goes on serving, so serving alone would prove nothing.
    log = deployment.worker.log()
    assert "Read-only file system" not in log and "Permission denied" not in log, log[-5000:]
    assert not [line for line in log.splitlines() if "| ERROR" in line], log[-5000:]
    assert (deployment.state / "state" / "sessions.sqlite3").exists()
    written = sorted(str(p) for where in deployment.writable for p in where.rglob("*") if p.is_file())
    print("written:", "\n  ".join(written))


def test_a_reply_is_not_redirected_to_another_users_topic(deployment: Deployment) -> None:
    """The worker's user may write every user's reply topic (the ACL), so only the worker's
    allow-list keeps bob's ResponseTopic from delivering into alice's session."""
    alice, bob = deployment.client("alice"), deployment.client("bob")
    try:
        bob.publish(
            "chat/bob/x1/request",
            {"message": "hi", "maxTokens": 2, "requestId": "x1"},
            properties=asking("chat/alice/s1/reply", b"c1"),
        )
        answer = bob.wait_topic("chat/bob/x1/reply", PATIENCE)
        assert answer.json()["requestId"] == "x1" and answer.properties.CorrelationData == b"c1"
        # alice's own request after it: a reply redirected to her topic would have reached her
        # before the answer to it.
        after = ask(alice, "alice", "s1", {"message": "hi", "maxTokens": 2, "requestId": "a-after"})
        assert after["requestId"] == "a-after", after
        assert not alice.received(lambda m: True), [(m.topic, m.payload) for m in alice.seen]
    finally:
        alice.close()
        bob.close()
    assert "A ResponseTopic of bob/x1 is not allowed" in deployment.worker.log()


def test_payload_message_and_max_tokens_limits(deployment: Deployment) -> None:
    bob = deployment.client("bob")
    try:
        cases = [
            ({"message": "x" * 3000}, "too_large", "the limit is 2048"),
            ({"message": "word " * 100}, "too_long", "the limit is 64"),
            ({"message": "hi", "maxTokens": 17}, "invalid_request", "16"),
        ]
        for i, (payload, code, says) in enumerate(cases):
            answer = ask(bob, "bob", f"l{i}", payload | {"requestId": f"b{i}"})
            assert code_of(answer) == code and says in answer["error"]["message"], answer
        ok = ask(bob, "bob", "l9", {"message": "hi", "maxTokens": 16, "requestId": "b9"})
        assert code_of(ok) is None, ok
    finally:
        bob.close()


def test_requests_per_user_per_minute(deployment: Deployment) -> None:
    carol = deployment.client("carol")
    try:
        # a new session each time: inventing sessions does not get around the limit
        for i in range(12):
            carol.publish(f"chat/carol/r{i}/request", {"message": "x", "maxTokens": 1, "requestId": f"c{i}"})
        codes = [code_of(carol.wait_topic(f"chat/carol/r{i}/reply", PATIENCE).json()) for i in range(12)]
        assert codes == [None] * 10 + ["rate_limited"] * 2, codes
    finally:
        carol.close()


def test_history_tokens_per_session_are_trimmed(deployment: Deployment) -> None:
    dave = deployment.client("dave")
    message = "tell me about the weather in the mountains today"
    try:
        prompts = [
            ask(dave, "dave", "h1", {"message": message, "maxTokens": 8, "requestId": f"d{i}"})["usage"]["promptTokens"]
            for i in range(6)
        ]
    finally:
        dave.close()
    # Every prompt is the same message after what is kept of the history: at most 64 tokens.
    assert max(prompts) > prompts[0], prompts  # the history is used
    assert all(p - prompts[0] <= 64 for p in prompts), prompts
    assert "Dialog trimmed: session=dave/h1" in deployment.worker.log()


def stats_reports(monitor: Client) -> list[dict[str, Any]]:
    """Every stats report the monitor got, up to one published after this call (so one that
    counts whatever was answered before)."""
    now = time.time()
    last = monitor.wait_for(lambda m: m.topic.endswith("/stats") and m.json()["timestamp"] > now, PATIENCE)
    return [m.json() for m in [*monitor.received(lambda m: m.topic.endswith("/stats")), last]]


def test_live_sessions_are_bounded_and_an_evicted_session_keeps_its_history(deployment: Deployment) -> None:
    erin = deployment.client("erin")
    monitor = deployment.client("monitor", ["chat/_worker/gpu-1/stats"])
    try:
        ask(erin, "erin", "s1", {"message": "my name is erin", "maxTokens": 8, "requestId": "e1"})
        for session in ("s2", "s3"):  # s1 is now the least recently used of three: out of memory
            ask(erin, "erin", session, {"message": "hello", "maxTokens": 2, "requestId": f"e-{session}"})
        again = ask(erin, "erin", "s1", {"message": "what is my name?", "maxTokens": 2, "requestId": "e2"})
        fresh = ask(erin, "erin", "s4", {"message": "what is my name?", "maxTokens": 2, "requestId": "e4"})
        reports = stats_reports(monitor)
    finally:
        erin.close()
        monitor.close()
    # s1's turn came back from the store: its prompt holds it
    assert again["usage"]["promptTokens"] > fresh["usage"]["promptTokens"], (again, fresh)
    assert reports and max(r["sessions"] for r in reports) <= 2, [r["sessions"] for r in reports]


def test_secrets_stay_out_of_the_log_the_stats_and_check_config(deployment: Deployment) -> None:
    secret = deployment.passwords["worker"]
    assert secret not in deployment.worker.log()
    monitor = deployment.client("monitor", ["chat/_worker/gpu-1/stats"])
    try:
        stats = monitor.wait_topic("chat/_worker/gpu-1/stats", PATIENCE)
    finally:
        monitor.close()
    assert secret.encode() not in stats.payload
    check = subprocess.run(
        [sys.executable, "-m", "worker", *deployment.args, "--check-config"],
        env={**os.environ, **deployment.env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=PATIENCE,
    )
    assert check.returncode == 0, check.stderr
    assert secret not in check.stdout + check.stderr
    assert 'password = "***"' in check.stdout and f"port = {deployment.tls_port}" in check.stdout


def test_no_content_in_the_log_or_the_stats(deployment: Deployment) -> None:
    marker = f"private-{secrets.token_hex(6)}"
    frank = deployment.client("frank")
    monitor = deployment.client("monitor", ["chat/_worker/gpu-1/stats"])
    try:
        answer = ask(frank, "frank", "p1", {"message": f"my secret is {marker}", "maxTokens": 16})
        reports = stats_reports(monitor)
    finally:
        frank.close()
        monitor.close()
    reply = answer["reply"].strip()
    log = deployment.worker.log()  # at INFO, the deployed level
    assert marker not in log and (len(reply) < 8 or reply not in log), reply
    assert reports and reports[-1]["processed"] > 0
    for report in reports:
        text = json.dumps(report)
        assert marker not in text and (len(reply) < 8 or reply not in text)


def test_reset_deletes_the_session_from_the_disk(deployment: Deployment) -> None:
    marker = f"forget-{secrets.token_hex(6)}"
    frank = deployment.client("frank")
    try:
        first = ask(frank, "frank", "p2", {"message": f"remember {marker}", "maxTokens": 8, "requestId": "f1"})
        assert marker.encode() in deployment.state_bytes()
        frank.publish("chat/frank/p2/control", {"action": "reset"})
        assert frank.wait_topic("chat/frank/p2/reply", PATIENCE).json() == {
            "sessionId": "p2",
            "action": "reset",
            "ok": True,
        }
        data = deployment.state_bytes()
        assert marker.encode() not in data
        assert len(first["reply"]) < 8 or first["reply"].encode() not in data  # shorter could be anywhere
        # the session starts over
        after = ask(frank, "frank", "p2", {"message": f"remember {marker}", "maxTokens": 8, "requestId": "f2"})
        assert after["usage"]["promptTokens"] == first["usage"]["promptTokens"]
    finally:
        frank.close()


def test_an_idle_session_expires_after_the_ttl(deployment: Deployment) -> None:
    marker = f"expire-{secrets.token_hex(6)}"
    grace = deployment.client("grace")
    try:
        first = ask(grace, "grace", "t1", {"message": f"note {marker}", "maxTokens": 8, "requestId": "g1"})
        assert marker.encode() in deployment.state_bytes()
        # session_ttl 30 s, checked every 3 s
        eventually(lambda: marker.encode() not in deployment.state_bytes(), "the session did not expire", interval=1)
        # the earlier tests' sessions expire too, in the same sweeps or others
        assert re.search(r"Expired \d+ session\(s\) idle for over 30s", deployment.worker.log())
        after = ask(grace, "grace", "t1", {"message": f"note {marker}", "maxTokens": 8, "requestId": "g2"})
        assert after["usage"]["promptTokens"] == first["usage"]["promptTokens"]  # it starts over
    finally:
        grace.close()
