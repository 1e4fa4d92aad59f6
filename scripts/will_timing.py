"""When does this machine's mosquitto publish the Will of a client that went silent?

Starts a private broker (the tests' configuration), connects raw MQTT 5 clients with a Will
and the given keepalive, one every STEP seconds; each sends a PINGREQ, reads the PINGRESP and
then says nothing more (as a frozen process would: its TCP connection stays open). Prints, for
each client, the seconds from that last packet to its Will arriving at a subscriber. MQTT says
1.5 x keepalive; docs/reliability.md ("Presence") has what mosquitto 2.0.11 does instead.

    .venv/bin/python scripts/will_timing.py --keepalive 5 --clients 60 --step 0.13
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
from devtools.mosquitto import Mosquitto  # noqa: E402 - the tests' broker and subscriber
from devtools.mqtt_client import Client  # noqa: E402


def _string(data: bytes) -> bytes:
    return struct.pack("!H", len(data)) + data


def _varint(n: int) -> bytes:
    out = b""
    while True:
        n, digit = divmod(n, 128)
        out += bytes([digit | (0x80 if n else 0)])
        if not n:
            return out


def connect_packet(client_id: str, keepalive: int, will_topic: str) -> bytes:
    """CONNECT, MQTT 5: clean start, a retained QoS 1 Will of "offline", no properties."""
    flags = 0x02 | 0x04 | 0x08 | 0x20  # clean start, will, will QoS 1, will retain
    header = _string(b"MQTT") + bytes([5, flags]) + struct.pack("!H", keepalive) + _varint(0)
    payload = _string(client_id.encode()) + _varint(0) + _string(will_topic.encode()) + _string(b"offline")
    body = header + payload
    return b"\x10" + _varint(len(body)) + body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keepalive", type=int, default=5)
    parser.add_argument("--clients", type=int, default=25)
    parser.add_argument("--step", type=float, default=0.3, help="seconds between two clients' last packets")
    args = parser.parse_args()
    broker = Mosquitto(Path(tempfile.mkdtemp()))
    broker.start()
    watcher = Client(broker.port, ["will/#"])
    last_packet: dict[str, float] = {}
    sockets = []
    start = time.monotonic()
    for n in range(args.clients):
        time.sleep(max(0.0, start + n * args.step - time.monotonic()))
        sock = socket.create_connection(("127.0.0.1", broker.port))
        sockets.append(sock)  # kept open, silent
        sock.sendall(connect_packet(f"silent-{n}", args.keepalive, f"will/{n}"))
        sock.recv(64)  # CONNACK
        sock.sendall(b"\xc0\x00")  # PINGREQ
        sock.recv(8)  # PINGRESP
        last_packet[f"will/{n}"] = time.monotonic()
    delays = []
    for _ in range(args.clients):
        will = watcher.wait_for(lambda m: m.topic.startswith("will/"), timeout=args.keepalive * 3 + 30)
        delays.append(time.monotonic() - last_packet[will.topic])
    delays.sort()
    span = f"{delays[0]:.2f}-{delays[-1]:.2f}"
    print(f"keepalive {args.keepalive} s, {args.clients} clients: Will {span} s after the last packet")
    print(" ".join(f"{d:.2f}" for d in delays))
    watcher.close()
    broker.stop()


if __name__ == "__main__":
    main()
